"""The playground of `refusion serve`: the page and its files, its settings made from
DecodeConfig's field metadata, the opt-in slot events of a stream (checked against the
decoder's own trace of the steps), and the page itself driven in headless Chromium
(skipped, with the reason, where no browser is installed)."""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from served import wait_for  # noqa: E402
from test_serve import GatedEngine, LiveServer  # noqa: E402

import refusion  # noqa: E402
from refusion.decode import DecodeConfig, generate  # noqa: E402
from refusion.decode.request import NOTES  # noqa: E402
from refusion.decode.trace import event_dicts, static_text, write_trace_html  # noqa: E402
from refusion.model.prompts import chat_ids, mask_id_of  # noqa: E402
from refusion.serve import create_app  # noqa: E402
from refusion.settings.recommended import recommended_of  # noqa: E402

KEY = "sesame"
# settings under which the bundled model's arithmetic example takes several steps with every
# phase: plans, global verification, infilling, corrections and rejected drafts
STEPPED = {"slot_size": 8, "serial_blocks": 1, "max_tokens": 96}


@pytest.fixture(scope="module")
def bundled():
    return refusion.load()


@contextmanager
def serving(bundled, **kwargs) -> Iterator[LiveServer]:
    model, tok = bundled
    server = LiveServer(create_app(model, tok, **kwargs))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(bundled):
    with serving(bundled) as s:
        yield s


def example(bundled, name: str = "arithmetic") -> str:
    return recommended_of(bundled[0]).examples[name]


def reference(bundled, prompt: str, settings: dict, trace: bool | str = "steps"):
    """What the decoder gives for `prompt` alone under the server's settings and `settings`."""
    model, tok = bundled
    fields = {k: v for k, v in settings.items() if k != "max_tokens"}
    cfg = recommended_of(model).decode_config(**fields, gen_length=settings["max_tokens"])
    ids = chat_ids(tok, [{"role": "user", "content": prompt}])  # as the chat route makes them
    return generate(model, tok, [ids], cfg, trace=trace)[0]


def stream(server, body: dict, headers: dict | None = None) -> list[dict]:
    """The chunks of a streamed chat completion."""
    chunks = []
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body | {"stream": True}, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


# ---------------------------------------------------------------------------- the recorder
def test_tracing_the_steps_changes_nothing_decoded(bundled):
    """trace="steps" adds notes to the commits trace=True records, and decodes the same."""
    prompt = example(bundled)
    plain = reference(bundled, prompt, STEPPED, trace=True)
    steps = reference(bundled, prompt, STEPPED)
    assert steps.token_ids == plain.token_ids
    assert [e for e in steps.trace if e.committed] == plain.trace
    kinds = collections.Counter(e.path for e in steps.trace)
    assert set(kinds) == {"plan", "fast", "infill", "correction", "rejected"}
    # one plan a step, of whole slots; the steps between plans verify the plan of the step
    # a row joined in, or infill (a round is plan and verification, then infilling when
    # verification left slots); each correction's token is the one committed there
    last = steps.trace[-1].step
    plans = [e.step for e in steps.trace if e.path == "plan"]
    assert plans == sorted(set(plans)) and plans[0] == 0
    for k in set(range(last + 1)) - set(plans):
        assert {e.path for e in steps.trace if e.step == k} <= {"fast", "infill", "correction", "rejected"}
    committed = {
        s + i: (e.step, t[i])
        for e in plain.trace
        for (s, _), t in zip(e.spans, e.tokens)
        for i in range(len(t))
    }
    for e in steps.trace:
        if e.path == "plan":
            assert all(s % 8 == 0 and n == 8 for s, n in e.spans)
        if e.path == "correction":
            ((pos, _),), ((tok,),) = e.spans, e.tokens
            # committed in that step, or in the infilling step after its verification
            step, committed_tok = committed.get(pos, (e.step, tok))
            assert committed_tok == tok and step in (e.step, e.step + 1)


def test_tracing_the_steps_under_the_checkpoints_settings(bundled):
    """The bundled model's own settings (one slot per block, where the engine narrows the
    plan or decodes a block as AR by the speed it measures, so two runs may take other
    steps to the same tokens): the same tokens, commits that replay them, and no note
    that holds a MASK (a token no plan drafted)."""
    model, tok = bundled
    mask = mask_id_of(model.config, tok)
    for prompt in recommended_of(model).examples.values():
        plain, steps = (generate(model, tok, [prompt], trace=t)[0] for t in (True, "steps"))
        assert steps.token_ids == plain.token_ids
        replay = {
            s + i: t
            for e in steps.trace
            if e.committed
            for (s, _), ts in zip(e.spans, e.tokens)
            for i, t in enumerate(ts)
        }
        assert [replay[i] for i in range(len(steps.token_ids))] == steps.token_ids
        assert all(mask not in toks for e in steps.trace for toks in e.tokens)


# ---------------------------------------------------------------------------- the page and its files
def test_the_page_and_its_files_are_served_and_offline(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    links = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert {"/static/slots.js", "/static/playground.js"} <= set(links)
    assert all(link.startswith("/static/") or link.startswith("data:") for link in links)
    for link in [x for x in links if x.startswith("/static/")]:
        r = httpx.get(server.url + link)
        assert r.status_code == 200 and not re.search(r"https?://", r.text), link  # nothing from elsewhere
    assert httpx.get(server.url + "/static/nope.js").status_code == 404


def test_the_trace_page_and_the_playground_draw_with_one_module(server, bundled, tmp_path):
    out = reference(bundled, example(bundled, "lists"), STEPPED)
    page = write_trace_html(tmp_path / "t.html", bundled[1], ["p"], [out], DecodeConfig(slot_size=8))
    served = httpx.get(server.url + "/static/slots.js").text
    assert served == static_text("slots.js") and served in page.read_text()


def test_settings_are_the_config_metadata_and_the_checkpoints(server, bundled):
    s = httpx.get(server.url + "/playground/settings").json()
    fields = {f["name"]: f for f in s["fields"]}
    http = [f for f in dataclasses.fields(DecodeConfig) if f.metadata["http"]]
    assert list(fields) == ["max_tokens"] + [f.name for f in http]
    for f in http:
        assert (fields[f.name]["help"], fields[f.name]["lo"], fields[f.name]["hi"]) == (
            f.metadata["help"],
            f.metadata["lo"],
            f.metadata["hi"],
        )
    assert (
        fields["method"]["choices"] == ["refusion", "ar", "mdm"] and fields["ar_correction"]["kind"] == "bool"
    )
    rec = recommended_of(bundled[0])
    assert s["examples"] == rec.examples and s["single_turn"] is True
    assert s["defaults"]["max_tokens"] == rec.decode["gen_length"]
    assert all(s["defaults"][k] == v for k, v in rec.decode.items() if k != "gen_length")
    gsm8k = s["presets"]["gsm8k"]
    assert [gsm8k[k] for k in ("slot_size", "serial_blocks", "slot_threshold", "token_threshold")] == [
        32,
        4,
        0.9,
        0.4,
    ]
    paper = s["presets"]["paper rule"]
    assert (paper["ar_correction"], paper["first_token_check"], paper["infill_window"]) == (
        False,
        False,
        None,
    )


def test_settings_say_which_draft_widths_are_in_force(server, bundled):
    from refusion.decode import EngineConfig

    def in_force(url: str) -> str:
        return httpx.get(url + "/playground/settings").json()["draft_widths"]["in_force"]

    assert in_force(server.url).startswith("adaptive")
    with serving(bundled, engine_config=EngineConfig(adaptive_drafts=False)) as s:
        assert in_force(s.url).startswith("fixed")


def test_behind_a_key_the_page_is_public_and_the_api_is_not(bundled):
    with serving(bundled, api_key=KEY) as s:
        assert httpx.get(s.url + "/").status_code == 200
        assert httpx.get(s.url + "/static/playground.js").status_code == 200
        assert httpx.get(s.url + "/playground/settings").status_code == 401
        ok = httpx.get(s.url + "/playground/settings", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200


# ---------------------------------------------------------------------------- the events
def test_slot_events_are_the_decoders_trace_of_the_steps(server, bundled):
    prompt = example(bundled)
    body = {"messages": [{"role": "user", "content": prompt}], "stream_options": {"include_slots": True}}
    chunks = stream(server, body | STEPPED)
    slots = [c["slots"] for c in chunks if "slots" in c]
    assert all(c["choices"] == [] for c in chunks if "slots" in c)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    ref = reference(bundled, prompt, STEPPED)
    assert [e for s in slots for e in s["events"]] == event_dicts(bundled[1], ref.trace)
    assert text == ref.text
    final = slots[-1]["stats"]
    assert (final["tokens"], final["nfe"]) == (len(ref.token_ids), ref.stats.nfe)
    # whether the text is AR decoding's own, as DecodeConfig.lossless says of the request's settings
    stepped = recommended_of(bundled[0]).decode_config(slot_size=8, serial_blocks=1, gen_length=96)
    assert stepped.lossless is None and (final["lossless"], final["temperature"]) == (None, 0.0)
    # several slots per block: the draft widths stay the settings' (a whole slot planned each step)
    assert (final["adaptive_widths"], final["plan_width"]) == (False, 8.0)
    # sent step by step, as the decoder went: each chunk holds one step's events, in order (a
    # step of infilling that commits nothing yet records none)
    steps = [{e["step"] for e in s["events"]} for s in slots]
    firsts = [min(st) for st in steps]
    assert all(len(st) == 1 for st in steps) and firsts == sorted(set(firsts)) and firsts[0] == 0
    assert [s["nfe"] for s in slots] == sorted(s["nfe"] for s in slots)


def test_completions_stream_slot_events_too(server, bundled):
    body = {"prompt": "Find the largest number: 47, 38, 23", "stream": True, "max_tokens": 16}
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json=body | {"stream_options": {"include_slots": True}},
        timeout=60,
    ) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    slots = [c for c in chunks if "slots" in c]
    assert slots and all(c["object"] == "text_completion" and c["choices"] == [] for c in slots)
    commits = [e for c in slots for e in c["slots"]["events"] if e["path"] not in NOTES]
    assert sum(n for e in commits for _, n in e["spans"]) >= slots[-1]["slots"]["stats"]["tokens"] > 0


def test_a_client_that_does_not_ask_sees_todays_chunks(server, bundled):
    body = {"messages": [{"role": "user", "content": example(bundled, "lists")}]}
    for options in ({}, {"stream_options": {"include_usage": True}}):
        chunks = stream(server, body | options)
        assert all(set(c) <= {"id", "object", "created", "model", "choices", "usage"} for c in chunks)
        assert all(c["choices"] or "usage" in c for c in chunks)


def test_slot_events_need_a_stream_and_a_boolean(server):
    body = {"messages": [{"role": "user", "content": "x"}]}
    for extra, stream_ in (({"include_slots": True}, False), ({"include_slots": "yes"}, True)):
        r = httpx.post(
            server.url + "/v1/chat/completions", json=body | {"stream": stream_, "stream_options": extra}
        )
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "stream_options.include_slots"


# ---------------------------------------------------------------------------- in a real browser
def _chromium() -> tuple[str, str]:
    """The browser and its driver, or a skip that says what to install."""
    pytest.importorskip("selenium", reason="selenium is not installed: scripts/setup.sh dev installs it")
    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser") if shutil.which(b)), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip(
            "no headless Chromium (chromium and chromedriver): scripts/setup.sh installs Debian's "
            "chromium and chromium-driver when it runs as root or with sudo"
        )
    return browser, driver


@pytest.fixture(scope="module")
def browser():
    binary, driver = _chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(arg)
    b = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield b
    finally:
        b.quit()


class Page:
    """The playground in the browser, read and driven by its element ids."""

    def __init__(self, browser, url: str) -> None:
        from selenium.webdriver.common.by import By

        self.b, self.by = browser, By
        browser.get(url)

    def find(self, css: str):
        return self.b.find_element(self.by.CSS_SELECTOR, css)

    def all(self, css: str) -> list:
        return self.b.find_elements(self.by.CSS_SELECTOR, css)

    def state(self, what: str) -> str:
        return self.find("body").get_attribute(f"data-{what}")

    def loaded(self) -> Page:
        wait_for(lambda: len(self.all("#examples button")) > 0, 30, "the settings and examples")
        return self

    def set(self, **values) -> None:
        for name, v in values.items():
            box = self.find(f"#fields [name={name}]")
            box.clear()
            box.send_keys(str(v))

    def example(self, where: str, name: str) -> None:
        next(b for b in self.all(f"#{where} button") if b.text == name).click()

    def finished(self, what: str) -> str:
        wait_for(lambda: self.state(what) in ("done", "error"), 60, f"the {what} to finish")
        return self.state(what)

    def cells(self, view: str) -> dict[int, tuple[int, str, str]]:
        """Committed cells of a slot view: position -> (step, phase, text), read at once
        (the view redraws as events come)."""
        cells = self.b.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0] + ' .cell.done'))"
            ".map(c => [+c.dataset.pos, +c.dataset.step, c.dataset.phase, c.textContent])",
            view,
        )
        return {pos: (step, phase, text) for pos, step, phase, text in cells}


def _shown(text: str) -> str:
    """A token's text as a cell shows it (slots.js: an empty one as a mark, newlines as arrows)."""
    return "\u2205" if text == "" else text.replace("\n", "\u21b5")


def committed_cells(tokenizer, out) -> dict[int, tuple[int, str, str]]:
    """What a slot view shows of a finished decoding: position -> (step, phase, text)."""
    return {
        s + i: (e.step, e.path, _shown(t))
        for e in out.trace
        if e.committed
        for (s, _), texts in zip(e.spans, event_dicts(tokenizer, [e])[0]["texts"])
        for i, t in enumerate(texts)
    }


def test_the_trace_page_replays_in_the_browser(browser, bundled, tmp_path):
    out = reference(bundled, example(bundled), STEPPED)
    page_file = write_trace_html(tmp_path / "t.html", bundled[1], ["p"], [out], DecodeConfig(slot_size=8))
    page = Page(browser, page_file.as_uri())
    steps = out.trace[-1].step + 1
    assert page.find(".step").text.startswith(f"step {steps} / {steps}: ")
    assert page.cells(".view") == committed_cells(bundled[1], out)
    page.find(".back").click()  # one step back: the last step's commits are gone
    last = {p for p, (s, _, _) in committed_cells(bundled[1], out).items() if s == steps - 1}
    assert set(page.cells(".view")) == set(committed_cells(bundled[1], out)) - last


@pytest.mark.parametrize("prompt", ["<!--<script>", "</script><b>x</b>", "a & b <!-- c"])
def test_the_trace_page_replays_any_prompt_text(browser, bundled, tmp_path, prompt):
    """A prompt that looks like markup (`<!--<script>` puts an HTML parser in its
    script-escape state, where the page's own end tag no longer ends the data) is shown
    as text, and the replay is drawn."""
    out = reference(bundled, example(bundled), STEPPED)
    page_file = write_trace_html(tmp_path / "t.html", bundled[1], [prompt], [out], DecodeConfig(slot_size=8))
    page = Page(browser, page_file.as_uri())
    assert page.find("pre.text").text == prompt
    assert page.cells(".view") == committed_cells(bundled[1], out)


def test_the_page_streams_an_answer_and_its_slots(browser, bundled):
    # each step slowed, so that the page is seen while it decodes
    with serving(bundled, engine=GatedEngine(bundled, delay=0.3)) as server:
        page = Page(browser, server.url + "/").loaded()
        page.set(**STEPPED)
        page.example("examples", "arithmetic")
        page.find("#send").click()
        wait_for(lambda: page.cells("#chat-view") and page.state("chat") == "running", 30, "a live commit")
        assert page.find("#chat-stats").text.startswith("steps ")
        assert page.finished("chat") == "done"
        ref = reference(bundled, example(bundled), STEPPED)
        assert page.all("#messages .assistant")[-1].text == ref.text.strip()
        assert page.cells("#chat-view") == committed_cells(bundled[1], ref)
        assert f"NFE {ref.stats.nfe} " in page.find("#chat-stats").text
        assert "done" in page.find("#chat-stats").text


def test_the_race_shows_both_decodings_live(browser, server, bundled):
    page = Page(browser, server.url + "/").loaded()
    page.find("#tab-race").click()
    page.example("race-examples", "arithmetic")
    page.set(**STEPPED)
    page.find("#race-go").click()
    assert page.finished("race") == "done"
    ar = reference(bundled, example(bundled), STEPPED | {"method": "ar"}, trace=False)
    texts = [page.find(f"#lane-{m} pre.text").text for m in ("ar", "refusion")]
    assert texts == [ar.text.strip()] * 2  # the bundled model's settings are lossless
    assert "the same text" in page.find("#race-verdict").text
    nfe = [
        int(re.search(r"NFE (\d+)", page.find(f"#lane-{m} .stats").text).group(1)) for m in ("ar", "refusion")
    ]
    assert nfe[1] < nfe[0]
    assert page.cells("#lane-ar .view") and page.cells("#lane-refusion .view")
    assert re.search(r"[\d.]+ tokens/s", page.find("#lane-refusion .stats").text)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("slot_threshold", "1.5", "slot_threshold must be between 0.0 and 1.0, got 1.5"),
        ("slot_size", "abc", "slot_size must be an integer, got 'abc' (str)"),
    ],
)
def test_a_bad_setting_shows_a_clear_message(browser, server, field, value, message):
    page = Page(browser, server.url + "/").loaded()
    page.set(**{field: value})
    page.find("#prompt").send_keys("Find the largest number: 47, 38, 23")
    page.find("#send").click()
    assert page.finished("chat") == "error"
    assert page.find("#error").text == message
    assert [e.get_attribute("data-name") for e in page.all(".field.invalid")] == [field]
    assert "Traceback" not in page.b.page_source and not page.all("#messages .assistant")


def test_behind_a_key_the_page_asks_for_it_and_keeps_it_in_the_page(browser, bundled):
    with serving(bundled, api_key=KEY) as server:
        page = Page(browser, server.url + "/")
        wait_for(lambda: page.find("#key-box").is_displayed(), 30, "the key prompt")
        page.find("#key").send_keys("wrong")
        page.find("#key-use").click()
        wait_for(lambda: page.find("#error").is_displayed(), 30, "the refusal")
        assert page.find("#error").text.startswith("invalid or missing API key")
        assert page.find("#key-box").is_displayed() and not page.all("#examples button")
        page.find("#key").send_keys(KEY)
        page.find("#key-use").click()
        page.loaded()
        assert not page.find("#key-box").is_displayed() and not page.find("#error").is_displayed()
        page.example("examples", "lists")
        page.find("#send").click()
        assert page.finished("chat") == "done"
        stored = page.b.execute_script(
            "return [localStorage.length, sessionStorage.length, document.cookie, location.href]"
        )
        assert stored == [0, 0, "", server.url + "/"]


def test_json_mode_holds_the_reply_to_a_json_object(browser, server, bundled):
    """The settings' JSON mode sends response_format json_object: the reply is the one the
    library gives under the JSON-object grammar, and a JSON object when it ends."""
    from refusion.decode.grammar import json_object_grammar

    page = Page(browser, server.url + "/").loaded()
    page.find("#json-mode").click()
    page.example("examples", "arithmetic")
    page.find("#send").click()
    assert page.finished("chat") == "done"
    length = recommended_of(bundled[0]).decode_config().gen_length  # the page's max_tokens
    ref = reference(
        bundled, example(bundled), {"grammar": json_object_grammar(), "max_tokens": length}, False
    )
    shown = page.all("#messages .assistant")[-1].text
    assert shown == ref.text.strip() and shown.startswith("{")
    if ref.finish_reason == "stop":
        assert isinstance(json.loads(shown), dict)
    page.find("#json-mode").click()  # off again for the tests after


def test_the_playground_chats_with_the_smollm2_model(browser):
    """`refusion serve bundled:refusion-smollm2`, driven in the browser: the page offers the
    real-language examples of its decode_config, and a chat with one streams the answer the
    library gives for the same prompt under the server's settings."""
    smol = refusion.load("bundled:refusion-smollm2")
    names = list(recommended_of(smol[0]).examples)
    assert names == ["question", "explain", "code", "advice"]
    with serving(smol) as server:
        page = Page(browser, server.url + "/").loaded()
        assert [b.text for b in page.all("#examples button")] == names
        page.set(max_tokens=24)
        page.example("examples", "question")
        page.find("#send").click()
        assert page.finished("chat") == "done"
        ref = reference(smol, example(smol, "question"), {"max_tokens": 24}, trace=False)
        assert "Paris" in ref.text
        assert page.all("#messages .assistant")[-1].text == ref.text.strip()
