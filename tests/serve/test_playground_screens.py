"""The playground on a desktop and on a phone, in headless Chromium: every pane fits the
screen, the slow-motion replay draws the recorded steps, and what the page says of
bounds, counts, draft widths and the checkpoint is what the server holds. With
REFUSION_SCREENSHOTS=DIR set, each screen is saved to DIR (docs/figures/playground holds
the committed ones); otherwise nothing is written."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
import test_playground as playground
from served import wait_for
from test_playground import STEPPED, Page, committed_cells, example, reference

# the playground tests' fixtures: the bundled model, a server of it, headless Chromium
bundled, server, browser = playground.bundled, playground.server, playground.browser

SCREENS = {"desktop": (1280, 800, False), "phone": (390, 844, True)}


class Screen(Page):
    """The page opened at a screen size (the viewport emulated exactly, a phone as a
    mobile screen), with the checks every pane must pass there."""

    def __init__(self, browser, url: str, size: str) -> None:
        width, height, mobile = SCREENS[size]
        browser.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile},
        )
        self.size = size
        super().__init__(browser, url)

    def fits(self) -> None:
        """Nothing is wider than the screen."""
        wide, inner = self.b.execute_script(
            "return [document.documentElement.scrollWidth, window.innerWidth]"
        )
        assert wide <= inner, f"{self.size}: the page is {wide} px wide on a {inner} px screen"

    def width(self, css: str) -> float:
        return self.b.execute_script(
            "return document.querySelector(arguments[0]).getBoundingClientRect().width", css
        )

    def settings(self, **values) -> None:
        """Set fields, unfolding the settings where the screen folds them."""
        box = self.find("#settings-box")
        folded = box.get_attribute("open") is None
        if folded:
            self.find("#settings-box summary").click()
        self.set(**values)
        if folded:
            self.find("#settings-box summary").click()

    def shoot(self, name: str, css: str | None = None) -> None:
        """Save the screen (scrolled to `css`) when REFUSION_SCREENSHOTS names a folder."""
        folder = os.environ.get("REFUSION_SCREENSHOTS")
        if css:
            self.b.execute_script("document.querySelector(arguments[0]).scrollIntoView()", css)
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            assert self.b.save_screenshot(str(Path(folder) / f"{self.size}_{name}.png"))


@pytest.fixture
def screen(browser):
    """A Screen maker; the emulated size is lifted afterwards, for the other tests."""
    yield lambda url, size: Screen(browser, url, size)
    browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


@pytest.mark.parametrize("size", list(SCREENS))
def test_every_pane_fits_the_screen(screen, server, bundled, size):
    page = screen(server.url + "/", size).loaded()
    assert (page.find("#settings-box").get_attribute("open") is None) == (size == "phone")
    page.fits()
    page.settings(**STEPPED)
    page.example("examples", "arithmetic")
    page.find("#send").click()
    assert page.finished("chat") == "done"
    page.fits()
    assert page.width("#chat-pane") >= (300 if size == "phone" else 600)
    page.shoot("chat")
    # the slot view in slow motion, one recorded step at a time (the steps that recorded
    # events: an infilling round that commits nothing yet records none), half-way through
    ref = reference(bundled, example(bundled), STEPPED)
    page.find("#chat-replay .pace option[value=step]").click()
    recorded = sorted({e.step for e in ref.trace})
    for _ in range(len(recorded) // 2):
        page.find("#chat-replay .fwd").click()
    last = recorded[len(recorded) // 2 - 1]
    half = {p: c for p, c in committed_cells(bundled[1], ref).items() if c[0] <= last}
    assert page.cells("#chat-view") == half
    assert page.find("#chat-step").text.startswith(f"step {last + 1}: ")
    page.fits()
    assert page.width("#chat-view") >= (300 if size == "phone" else 600)
    page.shoot("slots", "#chat-pane h3")
    page.find("#tab-race").click()
    page.example("race-examples", "arithmetic")
    page.find("#race-go").click()
    assert page.finished("race") == "done"
    page.fits()
    assert min(page.width("#lane-ar"), page.width("#lane-refusion")) >= 300
    page.shoot("race", "header")


def test_the_race_replays_its_recorded_steps_slowed(browser, server, bundled):
    page = Page(browser, server.url + "/").loaded()
    page.find("#tab-race").click()
    page.example("race-examples", "arithmetic")
    page.set(**STEPPED)
    page.find("#race-replay .pace option[value='10']").click()
    page.find("#race-go").click()
    assert page.finished("race") == "done"
    ar = reference(bundled, example(bundled), STEPPED | {"method": "ar"})
    # beside ReFusion, AR takes other steps than alone: the tokens are compared, not the steps
    full = {p: text for p, (_, _, text) in committed_cells(bundled[1], ar).items()}

    def drawn() -> dict[int, str]:
        return {p: text for p, (_, _, text) in page.cells("#lane-ar .view").items()}

    # the replay starts over when the race ends and draws at a tenth of the server's pace
    assert len(drawn()) < len(full)
    wait_for(lambda: drawn() == full, 60, "the replay to reach the end")
    where = page.find("#race-replay .where").text
    shown, total = map(float, re.search(r"([\d.]+) s of ([\d.]+) s", where).groups())
    assert shown == total > 0


def test_the_race_counts_agree(browser, server, bundled):
    """AR's NFE is its tokens (a token per forward), and its steps are the engine's steps,
    at least its forwards (a step is one forward at most); the page says why the two differ."""
    page = Page(browser, server.url + "/").loaded()
    page.find("#tab-race").click()
    page.example("race-examples", "code")
    page.find("#race-go").click()
    assert page.finished("race") == "done"
    stats = page.find("#lane-ar .stats").text
    counts = (r"steps (\d+)", r"NFE (\d+)", r"(\d+) tokens(?!/)")
    steps, nfe, tokens = (int(re.search(p, stats).group(1)) for p in counts)
    ar = reference(bundled, example(bundled, "code"), {"method": "ar", "max_tokens": 128}, trace=False)
    assert nfe == tokens == len(ar.token_ids) and steps >= nfe
    assert "NFE counts the forward passes" in page.find("#race-counts").text


def test_bounds_about_and_widths_are_the_servers(browser, server):
    s = httpx.get(server.url + "/playground/settings").json()
    fields = {f["name"]: f for f in s["fields"]}
    assert fields["seed"]["bounds"] == "[\u22122^63, 2^63 \u2212 1]"
    assert fields["top_k"]["bounds"] == "[0, 2147483647]"
    assert s["draft_widths"]["adaptive"] is True
    page = Page(browser, server.url + "/").loaded()
    assert page.find(".field[data-name=seed] .help").text.endswith("[\u22122^63, 2^63 \u2212 1]")
    # the checkpoint's `code` shown as code, its backticks gone
    assert "`" not in page.find("#about").text
    assert "refusion generate --examples" in [c.text for c in page.all("#about code")]
    assert page.find("#widths").text.startswith("Draft widths: adaptive")
    assert s["draft_widths"]["in_force"] in page.find("#widths").text  # the server's words
    # the largest seed the server takes reaches it exactly (a JavaScript number would round it up)
    page.set(seed=2**63 - 1, temperature=1.0, max_tokens=8)
    page.example("examples", "lists")
    page.find("#send").click()
    assert page.finished("chat") == "done"
    # the checkpoint's settings are lossless and greedy-only in layout: widths follow the batch
    page.set(temperature=0)
    page.find("#fields [name=seed]").clear()
    page.example("examples", "lists")
    page.find("#send").click()
    assert page.finished("chat") == "done"
    assert page.find("#chat-widths").text.startswith("draft widths: adaptive")
    page.set(**STEPPED)  # several slots per block: the widths are the settings'
    page.example("examples", "lists")
    page.find("#send").click()
    assert page.finished("chat") == "done"
    assert "draft widths: fixed by these settings" in page.find("#chat-widths").text
    assert "mean plan width 8.0 (slot_size 8)" in page.find("#chat-widths").text
