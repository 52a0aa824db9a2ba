"""The playground as a person uses it: headless Chromium (the system's, driven by Playwright) on
the package mesh, which has an API key and a control token. Type the secrets, generate and watch
the progress, sleep stage 1 and see generation refused with the API's own message, wake it and
generate again; a phone-sized window; every request the page makes stays on the gateway's origin.

A screenshot of each state goes to $STAGEMESH_TEST_ARTIFACTS/playground when that is set, else to
the test's tmp dir. Skipped without the playwright package or a chromium executable
(`apt-get install chromium`, `pip install playwright`; $STAGEMESH_CHROMIUM names another one)."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from PIL import Image

from tests.gateway.http.conftest import API_KEY, TOKEN, bearer

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="the playwright package is not installed (pip install playwright)"
)


def _chromium() -> str | None:
    named = os.environ.get("STAGEMESH_CHROMIUM")
    if named:
        return named
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome", "chrome")) if p), None)


CHROMIUM = _chromium()
if CHROMIUM is None:
    pytest.skip(
        "no chromium executable on PATH (apt-get install chromium, or set STAGEMESH_CHROMIUM)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.mesh, pytest.mark.browser]

WAIT_MS = 120_000  # only a bound on a failing test; a 3-step generation takes seconds on the CPU
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 360, "height": 740}


@pytest.fixture
def artifacts(tmp_path) -> Path:
    root = os.environ.get("STAGEMESH_TEST_ARTIFACTS")
    folder = Path(root) / "playground" if root else tmp_path / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM)
        yield launched
        launched.close()


class Recorded:
    """A page, every URL it requested and every console error, CSP violations included."""

    def __init__(self, page, origin: str):
        self.page = page
        self.origin = origin
        self.requests: list[str] = []
        self.console_errors: list[str] = []
        page.on("request", lambda request: self.requests.append(request.url))
        page.on("console", lambda message: message.type == "error" and self.console_errors.append(message.text))

    def foreign_requests(self) -> list[str]:
        def origin(url: str) -> str:
            parts = urlsplit(url.removeprefix("blob:"))  # a blob: URL is named after the page's origin
            return f"{parts.scheme}://{parts.netloc}"

        return [url for url in self.requests if origin(url) != self.origin]

    def policy_violations(self) -> list[str]:
        return [text for text in self.console_errors if "Content Security Policy" in text]


@pytest.fixture
def opened(browser, base_url):
    def open_page(viewport: dict) -> Recorded:
        context = browser.new_context(viewport=viewport, accept_downloads=True)
        opened.contexts.append(context)
        recorded = Recorded(context.new_page(), base_url)
        recorded.page.set_default_timeout(WAIT_MS)
        recorded.page.goto(f"{base_url}/")
        return recorded

    opened.contexts = []
    yield open_page
    for context in opened.contexts:
        context.close()


@pytest.fixture
def restore(base_url):
    """The next test finds stage 1 awake and generation open, whatever this one did."""
    yield
    with httpx.Client(base_url=base_url, headers=bearer(TOKEN), timeout=120) as control:
        control.post("/v1/omni/wakeup", json={"stage_ids": [1]})
        control.post("/v1/omni/resume")


def enter_secrets(page) -> None:
    """Type the key and token as a person would (Tab leaves each field, which uses it)."""
    page.get_by_label("API key").fill(API_KEY)
    page.keyboard.press("Tab")
    page.get_by_label("Control token").fill(TOKEN)
    page.keyboard.press("Tab")
    sync_api.expect(page.locator("#stage-1")).to_contain_text("serving")


def fill_request(page, prompt: str, width: int, height: int, steps: int, seed: int) -> None:
    page.get_by_label("Prompt", exact=True).fill(prompt)
    page.get_by_label("Width", exact=True).fill(str(width))
    page.get_by_label("Height", exact=True).fill(str(height))
    page.get_by_label("Steps", exact=True).fill(str(steps))
    page.get_by_label("Seed", exact=True).fill(str(seed))


def wait_for_results(page, count: int) -> None:
    sync_api.expect(page.locator("#result-list img")).to_have_count(count)
    page.wait_for_function(
        "n => [...document.querySelectorAll('#result-list img')].filter(i => i.complete && i.naturalWidth).length == n",
        arg=count,
    )


def downloaded_image(page, seed: int) -> Image.Image:
    """The newest result, through its download link: the bytes a person would save."""
    link = page.get_by_role("link", name=f"Download the image with seed {seed}")
    with page.expect_download() as download:
        link.click()
    return Image.open(io.BytesIO(Path(download.value.path()).read_bytes()))


def test_generate_sleep_refused_wake_generate_again(opened, base_url, artifacts, restore):
    recorded = opened(DESKTOP)
    page = recorded.page

    # The gateway has an API key: the page asks for it and shows the API's answer.
    sync_api.expect(page.locator("#access-needed")).to_contain_text("needs the API key")
    sync_api.expect(page.locator("#mesh-error")).to_contain_text("missing API key")
    page.screenshot(path=artifacts / "1-asks-for-the-key.png", full_page=True)

    enter_secrets(page)
    sync_api.expect(page.locator("#stage-0")).to_contain_text("ar")
    sync_api.expect(page.locator("#admission-state")).to_have_text("open")
    page.screenshot(path=artifacts / "2-mesh-serving.png", full_page=True)

    # Keyboard only: Enter in the seed field sends the form.
    fill_request(page, "a lighthouse at dusk", width=96, height=64, steps=3, seed=7)
    page.get_by_label("Seed", exact=True).press("Enter")
    wait_for_results(page, 1)
    events = page.locator("#events")
    sync_api.expect(events).to_contain_text("Stage 0 (ar) started.")
    sync_api.expect(events).to_contain_text("Stage 1 (diffusion) started.")
    sync_api.expect(events).to_contain_text("Stage 1: denoising step 3 of 3")
    sync_api.expect(page.locator("#progress-text")).to_have_text("Done.")
    shown = page.locator("#result-list img").first
    assert shown.evaluate("i => [i.naturalWidth, i.naturalHeight]") == [96, 64]
    assert shown.get_attribute("data-seed") == "7"
    sync_api.expect(page.locator("#result-list figcaption").first).to_contain_text("Seed 7 · 96x64 · PNG")
    image = downloaded_image(page, 7)
    assert (image.format, image.size) == ("PNG", (96, 64))
    page.screenshot(path=artifacts / "3-generated.png", full_page=True)

    # Sleep stage 1 from its row (level 1), then generation is refused with the API's message.
    page.get_by_label("Sleep level for stage 1").select_option("1")
    page.get_by_role("button", name="Sleep stage 1").click()
    sync_api.expect(page.locator("#control-status")).to_contain_text("Sleep stage 1: SUCCESS")
    sync_api.expect(page.locator("#stage-1")).to_contain_text("asleep, level 1")
    page.get_by_role("button", name="Generate", exact=True).click()
    refusal = page.locator("#request-error")
    sync_api.expect(refusal).to_be_visible()
    with httpx.Client(base_url=base_url, headers=bearer(API_KEY), timeout=60) as client:
        api = client.post("/v1/images/generations", json={"prompt": "a lighthouse", "stream": True})
    assert api.status_code == 409
    sync_api.expect(refusal.locator(".error-message")).to_have_text(api.json()["error"]["message"])
    sync_api.expect(refusal.locator(".error-detail")).to_contain_text("HTTP 409 · code: failed_precondition")
    assert "stage 1 is asleep" in api.json()["error"]["message"]
    page.screenshot(path=artifacts / "4-refused-while-asleep.png", full_page=True)

    # Wake it; a pipeline with an AR stage stays paused until resumed.
    page.get_by_role("button", name="Wake stage 1").click()
    sync_api.expect(page.locator("#control-status")).to_contain_text("Wake stage 1: SUCCESS")
    sync_api.expect(page.locator("#stage-1")).to_contain_text("awake")
    page.get_by_role("button", name="Resume generation").click()
    sync_api.expect(page.locator("#admission-state")).to_have_text("open")

    page.get_by_label("Seed", exact=True).fill("8")
    page.get_by_role("button", name="Generate", exact=True).click()
    wait_for_results(page, 2)
    sync_api.expect(refusal).to_be_hidden()
    assert page.locator("#result-list img").first.get_attribute("data-seed") == "8"
    assert downloaded_image(page, 8).size == (96, 64)
    page.screenshot(path=artifacts / "5-woken-and-generated-again.png", full_page=True)

    # Nothing the page did left the gateway's origin, or kept a secret anywhere but the tab's fields.
    assert recorded.requests, "no request was recorded"
    assert recorded.foreign_requests() == []
    paths = {urlsplit(u).path for u in recorded.requests}
    assert {"/", "/v1/omni/stages", "/v1/images/generations", "/v1/omni/sleep", "/v1/omni/wakeup"} <= paths
    assert recorded.policy_violations() == []
    kept = page.evaluate("[localStorage.length, sessionStorage.length, document.cookie]")
    assert kept == [0, 0, ""]
    html = page.content()
    assert API_KEY not in html and TOKEN not in html


def test_at_phone_width_the_page_fits_and_names_the_field_at_fault(opened, artifacts):
    recorded = opened(PHONE)
    page = recorded.page
    enter_secrets(page)
    # No sideways scrolling at 360 px: the stage table turns into one card per stage.
    assert page.evaluate("document.scrollingElement.scrollWidth") <= PHONE["width"]
    sync_api.expect(page.locator("#stage-1 td[data-label='Queue']")).to_have_text("0")

    fill_request(page, "a kite", width=100, height=64, steps=1, seed=1)
    page.get_by_role("button", name="Generate", exact=True).click()
    refusal = page.locator("#request-error")
    sync_api.expect(refusal.locator(".error-detail")).to_contain_text("field: size · HTTP 400")
    sync_api.expect(refusal.locator(".error-message")).to_contain_text("size:")
    sync_api.expect(page.locator("#size-error")).to_be_visible()
    width = page.get_by_label("Width", exact=True)
    sync_api.expect(width).to_have_attribute("aria-invalid", "true")
    sync_api.expect(width).to_be_focused()  # the person lands on the field to fix
    page.screenshot(path=artifacts / "phone-field-error.png", full_page=True)

    width.fill("64")
    page.get_by_role("button", name="Generate", exact=True).click()
    wait_for_results(page, 1)
    sync_api.expect(refusal).to_be_hidden()
    assert page.evaluate("document.scrollingElement.scrollWidth") <= PHONE["width"]
    page.screenshot(path=artifacts / "phone-generated.png", full_page=True)

    # An edit: the starting image sets the size; the request goes to /v1/images/edits.
    start = io.BytesIO()
    Image.new("RGB", (48, 32), (200, 90, 30)).save(start, format="PNG")
    page.get_by_label("Image file").set_input_files(
        files=[{"name": "start.png", "mimeType": "image/png", "buffer": start.getvalue()}]
    )
    sync_api.expect(page.get_by_label("Strength")).to_be_enabled()
    sync_api.expect(page.get_by_label("Width", exact=True)).to_have_value("")
    page.get_by_label("Strength").fill("0.5")
    page.get_by_label("Steps", exact=True).fill("2")
    page.get_by_label("Seed", exact=True).fill("3")
    page.get_by_role("button", name="Generate", exact=True).click()
    wait_for_results(page, 2)
    sync_api.expect(page.locator("#events")).to_contain_text("Sent to /v1/images/edits.")
    assert page.locator("#result-list img").first.evaluate("i => [i.naturalWidth, i.naturalHeight]") == [48, 32]
    assert "/v1/images/edits" in {urlsplit(u).path for u in recorded.requests}

    # A long request shows in stage 1's queue; Cancel ends it there too (the page's own refresh says so).
    page.get_by_label("Image file").set_input_files(files=[])
    fill_request(page, "a long night", width=512, height=512, steps=200, seed=4)
    page.get_by_label("Prompt", exact=True).press("Control+Enter")
    sync_api.expect(page.locator("#events")).to_contain_text("denoising step")
    queue = page.locator("#stage-1 td[data-label='Queue']")
    sync_api.expect(queue).to_have_text("1")
    page.get_by_role("button", name="Cancel").click()
    sync_api.expect(page.locator("#progress-text")).to_contain_text("Cancelled")
    sync_api.expect(queue).to_have_text("0")
    sync_api.expect(page.locator("#result-list img")).to_have_count(2)
    assert recorded.foreign_requests() == []
    assert recorded.policy_violations() == []
