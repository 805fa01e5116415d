"""Small, fixed vocabularies of entities, so a tiny model sees each one often."""

NAMES = (
    "Mia", "Leo", "Ava", "Sam", "Noah", "Emma", "Liam", "Zoe", "Max", "Lily",
    "Ben", "Ella", "Jack", "Ruby", "Owen", "Nora", "Luke", "Ivy", "Adam", "Grace",
    "Ryan", "Chloe", "Eli", "Anna", "Finn", "Rose", "Omar", "Maya", "Hugo", "Lucy",
)

# Plural nouns for the word problems (quantities in prompts are always >= 2).
OBJECTS = (
    "apples", "pears", "cookies", "marbles", "stickers", "pencils", "books",
    "cards", "coins", "shells", "stamps", "balloons", "candies", "eggs", "cups",
    "plums", "toys", "beads", "rocks", "buttons",
)

# Short lowercase words for the string rewrites.
WORDS = (
    "cat", "dog", "sun", "moon", "tree", "fish", "bird", "star", "rain", "snow",
    "book", "lamp", "door", "milk", "cake", "ship", "rock", "leaf", "rose", "wolf",
    "bear", "frog", "kite", "ring", "coin", "drum", "bell", "nest", "king", "road",
)

# Function names for the code family: the prompt names the function.
FUNC_NAMES = (
    "solve", "compute", "process", "calc", "helper", "transform",
    "evaluate", "score", "apply", "run", "count_it", "total",
)
