#!/usr/bin/env python
"""The playground's screenshots in docs/figures/ (shown in docs/playground.md and the README), made again:

    .venv/bin/python scripts/playground_figures.py

Serves the bundled model on a free loopback port and drives the page in headless
Chromium (Debian's chromium and chromium-driver, and selenium: `scripts/setup.sh dev`
installs them): the slot view of a chat reply mid-generation, with every engine step
slowed by --delay seconds so that it can be caught half-way (the bundled model decodes a
reply in a fraction of a second), then a race of AR against ReFusion at full speed (its
tokens/s are this machine's)."""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import refusion
from refusion.decode import Engine
from refusion.serve import create_app
from refusion.serve.server import make_server

OUT = Path(__file__).resolve().parent.parent / "docs" / "figures"
# the settings the pictures use: 8-token slots in one block, so the steps are many and varied
SETTINGS = {"slot_size": "8", "serial_blocks": "1", "max_tokens": "96"}


class SlowEngine(Engine):
    """The engine, each step held back by `delay` seconds."""

    delay = 0.0

    def step(self):
        time.sleep(self.delay)
        return super().step()


def serve(delay: float) -> tuple[str, object, SlowEngine]:
    model, tok = refusion.load()
    engine = SlowEngine(model, tok)
    engine.delay = delay
    server = make_server(create_app(model, tok, engine=engine), log_level="warning")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, engine


def browser(width: int, height: int):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def until(cond, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise SystemExit("the page did not get there in time")
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay", type=float, default=0.6, help="seconds each engine step is held back")
    ap.add_argument("--mid-step", type=int, default=3, help="the chat picture is taken after this many steps")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if not (shutil.which("chromedriver") and (shutil.which("chromium") or shutil.which("chromium-browser"))):
        print(
            "needs chromium and chromedriver: scripts/setup.sh dev installs them (as root)", file=sys.stderr
        )
        return 2
    url, server, engine = serve(args.delay)
    from selenium.webdriver.common.by import By

    b = browser(1400, 900)
    try:
        b.get(url + "/")
        until(lambda: b.find_elements(By.CSS_SELECTOR, "#examples button"))
        for name, value in SETTINGS.items():
            box = b.find_element(By.CSS_SELECTOR, f"#fields [name={name}]")
            box.clear()
            box.send_keys(value)
        body = b.find_element(By.TAG_NAME, "body")
        next(
            e for e in b.find_elements(By.CSS_SELECTOR, "#examples button") if e.text == "arithmetic"
        ).click()
        b.find_element(By.ID, "send").click()
        step = "return document.querySelector('#chat-stats').textContent"
        until(lambda: b.execute_script(step).startswith(f"step {args.mid_step} "))
        args.out.mkdir(parents=True, exist_ok=True)
        b.save_screenshot(str(args.out / "playground_slots.png"))
        until(lambda: body.get_attribute("data-chat") != "running")
        engine.delay = 0.0
        b.find_element(By.ID, "tab-race").click()
        next(
            e for e in b.find_elements(By.CSS_SELECTOR, "#race-examples button") if e.text == "arithmetic"
        ).click()
        b.find_element(By.ID, "race-go").click()
        until(lambda: body.get_attribute("data-race") != "running", 300)
        b.save_screenshot(str(args.out / "playground_race.png"))
    finally:
        b.quit()
        server.should_exit = True
    print(f"wrote {args.out / 'playground_slots.png'} and {args.out / 'playground_race.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
