"""The chat page at GET / in a real headless browser (Debian's chromium and chromium-driver,
driven by selenium): type a question, see the answer stream in, with tokens/s and the share of
the context the KV policy read under it."""
from __future__ import annotations

import os
import shutil

import pytest

from tests.serve.live import Server

pytestmark = pytest.mark.slow  # the prepared SmolLM2's tokenizer (tests/serve/conftest.py)
REQUIRE_ENV = "FLEXGEN_SPARPR_REQUIRE_BROWSER"  # .ci/run installs the browser and sets it: no silent skip


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in requirements.txt")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        why = "needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(why)
        pytest.skip(why)
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(arg)
    b = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver), options=opts)
    b.set_page_load_timeout(30)
    yield b
    b.quit()


def test_type_a_question_and_see_a_streamed_answer(browser, tiny_chat_dir, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    s = Server(["--model", str(tiny_chat_dir), "--gpu-batch-size", "1", "--kv-policy", "sparpr",
                "--keep-ratio", "0.25", "--block-size", "16"], tmp_path)
    try:
        browser.get(s.url + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda b: b.find_element(By.ID, "model").text == str(tiny_chat_dir))
        max_box = browser.find_element(By.ID, "max")
        max_box.clear()
        max_box.send_keys("40")
        # count the answer's text changes as they happen: a streamed answer grows in several
        browser.execute_script("""
            window.changes = 0;
            new MutationObserver(() => {
              const a = document.querySelector('.assistant');
              if (a && a.textContent.length) window.changes += 1;
            }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});""")
        browser.find_element(By.ID, "question").send_keys("What does a KV cache hold?" + Keys.ENTER)
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, ".facts[data-done]"))
        answer = browser.find_element(By.CSS_SELECTOR, ".assistant").text
        facts = browser.find_element(By.CSS_SELECTOR, ".facts").text
        assert answer.strip() and browser.execute_script("return window.changes") > 3
        assert "tokens/s" in facts and "KV read:" in facts and "% of the context" in facts
    finally:
        assert s.stop() == 0
