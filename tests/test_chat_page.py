"""The chat page at `/` on the real server (with an API key): served without the key and self-contained; and in
a real browser (headless Chromium through Selenium, in make test-slow): the key asked for, a reply streamed,
stopped, regenerated, and a reply under a JSON schema that parses, with no console errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import jsonschema
import pytest
from server_util import KEY


def test_the_page_is_served_without_the_key_and_needs_nothing_from_elsewhere(http, server):
    import httpx

    bare = httpx.Client(base_url=server.url, timeout=10)  # no key
    page = bare.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert 'data-needs-key="true"' in page.text  # the server has a key: the page asks for it first
    for path, kind in (("/chat.js", "text/javascript"), ("/chat.css", "text/css")):
        r = bare.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and len(r.text) > 500
    assert bare.get("/v1/models").status_code == 401  # the API still needs the key
    html_refs = re.findall(r'(?:src|href)="([^"]*)"', page.text)
    assert html_refs and all(ref.startswith("/") or ref == "data:," for ref in html_refs), html_refs
    script = bare.get("/chat.js").text
    assert not re.search(r'fetch\(\s*["`]https?:', script) and "import " not in script  # this server only
    assert "innerHTML = markdown(" in script and "escapeHtml(s)" in script  # the model's text is escaped first


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        opts.add_argument(arg)
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))


def _wait(what, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = what()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("chromedriver"), reason="needs chromium and chromium-driver (make test-slow installs them)")
def test_a_conversation_in_a_real_browser(server):
    from selenium.webdriver.common.by import By

    driver = _browser()
    find = lambda css: driver.find_element(By.CSS_SELECTOR, css)  # noqa: E731
    replies = lambda: driver.find_elements(By.CSS_SELECTOR, ".message.assistant .content")  # noqa: E731
    try:
        driver.get(server.url)
        _wait(lambda: find("#key-dialog").get_attribute("open") is not None)
        find("#key").send_keys(KEY)
        find("#key-ok").click()
        _wait(lambda: "context" in find("#model").text)
        for field, value in (("#temperature", "0"), ("#max-tokens", "400")):
            find(field).clear()
            find(field).send_keys(value)

        # a reply streams in, and Stop ends it where it is
        find("#input").send_keys("Tell me a long story about a dragon and a knight.")
        find("#send").click()
        seen = set()
        _wait(lambda: seen.add(len(replies()[0].text)) or len(seen - {0}) >= 3)  # it grows while streaming
        assert find("#stop").is_enabled() and not find("#send").is_enabled()
        find("#stop").click()
        _wait(lambda: "Stopped" in find("#status").text)
        stopped = replies()[0].text
        assert stopped and find("#send").is_enabled()
        time.sleep(0.5)
        assert replies()[0].text == stopped  # nothing more arrives

        # regenerate replaces the reply (greedy: the same story again, now to its end or the limit)
        find("#regenerate").click()
        _wait(lambda: find("#send").is_enabled() and replies() and len(replies()[0].text) > len(stopped))
        assert len(replies()) == 1 and replies()[0].text.startswith(stopped[:40])

        # under a JSON schema the reply parses and validates
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "population": {"type": "integer"}},
                  "required": ["city", "population"]}
        find("#new-chat").click()
        find("#schema").send_keys(json.dumps(schema))
        find("#input").send_keys("Give me a city as JSON.")
        find("#send").click()
        badge = _wait(lambda: driver.find_elements(By.CSS_SELECTOR, ".message.assistant .badge"))
        assert badge[0].text == "parses as JSON"
        jsonschema.validate(json.loads(replies()[0].text), schema)

        # the conversation survives a reload (kept in the browser), and the page logged no error
        driver.refresh()
        _wait(lambda: len(replies()) == 1 and "population" in replies()[0].text)
        if os.environ.get("PLAIT_SCREENSHOT"):  # docs/serving.md's picture: PLAIT_SCREENSHOT=docs/img/chat-page.png
            driver.save_screenshot(os.environ["PLAIT_SCREENSHOT"])
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        driver.quit()
