"""The trusted side of a check (copied, with `wire.py`, into a folder of its own; it
never runs inside the evaluator, and the candidate's code never runs in it).

It runs the benchmark's own test code. Each name the test uses from the candidate's
program is a `Remote` here: a call sends the arguments to the sandbox over a pipe and
gets back plain data only (`wire.py`: numbers, numpy's among them, as their exact
values); an object of the program's making comes back as a reference that can only be
handed back to the program, or, for an iterator (a generator, a `map`), drawn from item by
item. Assertions, `==`, `abs`, `math.isclose` all run here, on those values. The verdict
goes to the evaluator on a pipe of its own, which the candidate's process does not hold.
What makes a check fail, and the reason it carries:

- the candidate did not load (a syntax error, an exception at top level): "load";
- a call returned something that is not plain data, or the test used a reference as a
  value (compared it, asked its truth or length), or drew more than `MAX_ITEMS` from an
  iterator: "not plain data", even when the test would have caught the exception it
  raises here;
- its process ended before the test finished: "exit" (the evaluator adds how: signal,
  memory, exit code);
- an assertion of the test failed: "assertion", with the test's line;
- anything else the test raised: "error" (a candidate's own exception among them).
"""

import builtins
import json
import os
import resource
import sys
import traceback

_TEST_FILE = "<test>"
MAX_ITEMS = 100_000  # items the checker draws from one iterator of the program's (30 us each)
# exceptions a candidate may raise that the test may expect (`with pytest.raises`-style
# checks): re-raised here as the same builtin type, with the message as plain text
_EXCEPTIONS = {
    n: getattr(builtins, n)
    for n in dir(builtins)
    if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), Exception)
}


class CandidateGone(BaseException):
    """The candidate's process closed its end: it exited or was killed."""


class CandidateError(Exception):
    """The candidate raised an exception that is not a builtin one."""


class Remote:
    """An object that lives in the program's process: one of its top-level names, or an
    object of its making that a call returned. It can be called or handed back to the
    program's functions; any other use (comparing it, testing its truth, reading it) is
    not plain data, so nothing the program made ever decides an assertion here."""

    __slots__ = ("_key", "_what", "_channel")
    _key: list
    _what: str
    _channel: "Channel"

    def __init__(self, channel, key, what):
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_what", what)
        object.__setattr__(self, "_channel", channel)

    def __call__(self, *args, **kwargs):
        return self._channel.call(self._key, args, kwargs, self._what)

    def __repr__(self):
        return f"<{self._what}>"

    def _refuse(self, *args, **kwargs):
        raise self._channel.violated(self._channel.wire.NotPlainData(f"{self._what} is not plain data"))

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __len__ = __iter__ = __contains__ = (
        _refuse
    )
    __getitem__ = __getattr__ = __setattr__ = __hash__ = __index__ = __int__ = __float__ = __str__ = (
        __format__
    ) = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __abs__ = __neg__ = _refuse


class RemoteIterator(Remote):
    """An iterator that lives in the program's process (a generator, a `map`): the test
    may draw its items, each a plain value or a reference, as many as `MAX_ITEMS`
    (`list(f(x)) == [...]`, `next(f(x))`, a `for` loop); it has no length, as none of
    those has."""

    __slots__ = ("_drawn",)
    _drawn: int

    def __init__(self, channel, key, what):
        super().__init__(channel, key, what)
        object.__setattr__(self, "_drawn", 0)

    def __iter__(self):
        return self

    def __next__(self):
        if self._drawn >= MAX_ITEMS:
            raise self._channel.violated(
                self._channel.wire.NotPlainData(f"{self._what} gave more than {MAX_ITEMS} items")
            )
        object.__setattr__(self, "_drawn", self._drawn + 1)
        return self._channel.next_item(self._key, self._what)

    def __len__(self):
        raise TypeError(f"{self._what} has no len()")

    def __contains__(self, value):  # as Python does for an iterator: draw until found
        return any(item is value or item == value for item in self)


class Channel:
    def __init__(self, wire, calls, replies):
        self.wire, self.calls, self.replies = wire, calls, replies
        self.violation = None  # the first protocol violation: fails the check even if swallowed

    def violated(self, error):
        self.violation = self.violation or error
        return error

    def receive(self):
        line = self.wire.read_line(self.replies)
        if not line:
            raise self.violated(CandidateGone())
        try:
            return self.wire.loads(line)
        except self.wire.NotPlainData as e:
            raise self.violated(e) from None

    def name(self, name):
        return Remote(self, ["n", name], f"the program's {name}")

    def _ref(self, value):
        if isinstance(value, Remote):
            return value._key
        raise self.wire.NotPlainData(f"the test passed a {type(value).__name__}, which is not plain data")

    def _resolve(self, key):
        """A reference of the program's: an iterator when it says so (all the program can
        gain by saying so falsely is a TypeError of its own making when drawn from)."""
        if type(key) is list and len(key) in (3, 4) and key[0] == "h" and type(key[1]) is int:
            what = f"a {str(key[2])[:60]} of the program's"
            if len(key) == 4 and key[3] == "iter":
                return RemoteIterator(self, key[:2], what)
            return Remote(self, key[:2], what)
        raise self.wire.NotPlainData("a malformed reference")

    def call(self, key, args, kwargs, what):
        wire = self.wire
        try:
            message = {
                "call": key,
                "args": wire.to_json(tuple(args), ref=self._ref),
                "kwargs": wire.to_json(dict(kwargs), ref=self._ref),
            }
        except wire.NotPlainData as e:
            raise TypeError(str(e)) from None  # the test's own argument: an error of the test
        return self._answer(self._ask(message), f"{what} returned", what)

    def next_item(self, key, what):
        """The next item of the program's iterator `key`; StopIteration at its end."""
        reply = self._ask({"next": key})
        if reply.get("stop") is True:
            raise StopIteration
        return self._answer(reply, f"{what} gave", what)

    def _ask(self, message):
        try:
            self.calls.write(self.wire.dumps(message))
            self.calls.flush()
        except BrokenPipeError:
            raise self.violated(CandidateGone()) from None
        return self.receive()

    def _answer(self, reply, gave, what):
        """The value of a reply, or the exception the program raised, re-raised here."""
        wire = self.wire
        try:
            if "ok" in reply:
                return wire.from_json(reply["ok"], resolve=self._resolve)
            if "notplain" in reply:
                raise wire.NotPlainData(f"{gave} {str(reply['notplain'])[:200]}")
            if "raise" not in reply:
                raise wire.NotPlainData(f"a malformed reply about {what}")
        except wire.NotPlainData as e:
            raise self.violated(e) from None
        kind, text = (list(reply["raise"]) + ["", ""])[:2]
        raise _EXCEPTIONS.get(str(kind), CandidateError)(f"{kind}: {text}"[:1000])


def _assert_line(test_lines, tb):
    """The line of the test where an assertion failed."""
    for frame in reversed(traceback.extract_tb(tb)):
        if frame.filename == _TEST_FILE and frame.lineno is not None and 0 < frame.lineno <= len(test_lines):
            return f"line {frame.lineno}: {test_lines[frame.lineno - 1].strip()[:200]}"
    return "the test's assertion"


def verdict(job, channel):
    """(passed, reason) of running the job's test against the candidate."""
    wire = channel.wire
    try:
        first = channel.receive()
    except CandidateGone:
        return False, "exit: the program ended before it loaded"
    except wire.NotPlainData as e:
        return False, f"not plain data: {e}"
    if "load_error" in first:
        return False, f"load: {str(first['load_error'])[:300]}"
    if first.get("ready") is not True:
        return False, "not plain data: a malformed first message"
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(job["setup"], "<setup>", "exec"), namespace)
    except Exception as e:
        return False, f"error: the test's own setup failed ({type(e).__name__}: {e})"
    for name in job["calls"]:
        namespace[name] = channel.name(name)
    test_lines = job["test"].splitlines()
    try:
        exec(compile(job["test"], _TEST_FILE, "exec"), namespace)
    except CandidateGone:
        return False, "exit: the program ended before the test finished"
    except wire.NotPlainData as e:
        return False, f"not plain data: {e}"
    except AssertionError:
        return False, f"assertion: {_assert_line(test_lines, sys.exc_info()[2])}"
    except RecursionError:
        return False, "error: RecursionError"
    except Exception as e:
        return False, f"error: {type(e).__name__}: {str(e)[:300]}"
    if channel.violation is not None:  # raised inside the test and caught there
        kind = "exit" if isinstance(channel.violation, CandidateGone) else "not plain data"
        return False, f"{kind}: {channel.violation or 'the program ended'} (caught by the test)"
    return True, ""


def _main():
    settings = json.loads(os.environ.pop("REFUSION_CHECKER_SETTINGS"))
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import wire  # noqa: E402 - the plain-data codec copied beside this file

    sys.path.remove(here)
    sys.path.extend(settings["site_packages"])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    memory = settings["memory_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    with open(os.path.join(here, "job.json"), encoding="utf-8") as f:
        job = json.load(f)
    out = os.fdopen(settings["verdict_fd"], "w")
    channel = Channel(wire, os.fdopen(settings["calls_fd"], "wb"), os.fdopen(settings["replies_fd"], "rb"))
    try:
        passed, reason = verdict(job, channel)
    except MemoryError:
        passed, reason = False, "memory: the checker ran out of memory on the program's values"
    out.write(json.dumps({"passed": passed, "reason": reason}))
    out.flush()
    os._exit(0)


if __name__ == "__main__":
    _main()
