"""Build the book and check every page in a real browser (headless Chromium, driven by Playwright).

    python scripts/check_site.py                  # build into build/site/, check, screenshots in build/site-check/
    python scripts/check_site.py --no-build       # check the site already in build/site/

Each page must load without console errors, every image must decode, no page may be wider than a
1280-pixel window, and each chapter's diff must be folded (its `<details>` closed). Missing tools are
installed first: Debian's `chromium` package (apt, as root) and Playwright (pip, into this interpreter's
environment; Playwright drives the system Chromium, it downloads no browser of its own).
"""

import argparse
import functools
import http.server
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "build" / "site"
SHOTS = ROOT / "build" / "site-check"
CHROMIUM = Path("/usr/bin/chromium")
PLAYWRIGHT = "playwright==1.65.2"
WIDTH, HEIGHT = 1280, 900
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

# What the browser reports about one page, read in the page itself.
PAGE_FACTS = """() => ({
    scrollWidth: document.documentElement.scrollWidth,
    brokenImages: [...document.images].filter(img => !(img.complete && img.naturalWidth > 0))
                                      .map(img => img.getAttribute("src").slice(0, 80)),
    images: document.images.length,
    diffFolds: document.querySelectorAll("details.chapter-diff").length,
    openDiffFolds: document.querySelectorAll("details.chapter-diff[open]").length,
})"""


def ensure_tools() -> None:
    if not CHROMIUM.is_file():
        print("installing Debian's chromium (apt-get) ...", flush=True)
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True)
    if importlib.util.find_spec("playwright") is None:
        print(f"installing {PLAYWRIGHT} (pip) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", PLAYWRIGHT], check=True)


def build_site() -> None:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    subprocess.run([str(mkdocs), "build", "--strict", "--quiet", "--site-dir", str(SITE)], cwd=ROOT, check=True)


def serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve `folder` on a free local port, in a background thread."""
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def site_pages(site: Path) -> list[str]:
    """Every page's path relative to the site root, e.g. "" or "chapters/ch01_naive_decode/"."""
    pages = []
    for index in sorted(site.rglob("index.html")):
        relative = index.parent.relative_to(site).as_posix()
        if relative != "search":
            pages.append("" if relative == "." else relative + "/")
    return pages


def check_page(context, url: str, path: str) -> list[str]:
    """Load one page; return what is wrong with it, and save its screenshots."""
    page = context.new_page()
    errors = []
    page.on("console", lambda message: errors.append(f"console: {message.text}") if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(f"page error: {error}"))
    response = page.goto(url + path, wait_until="load")
    if response is None or not response.ok:
        errors.append(f"HTTP {response.status if response else 'no response'}")
    page.wait_for_load_state("networkidle")
    facts = page.evaluate(PAGE_FACTS)
    if facts["brokenImages"]:
        errors.append(f"images that do not decode: {facts['brokenImages']}")
    if facts["scrollWidth"] > WIDTH:
        errors.append(f"page is {facts['scrollWidth']} px wide, wider than the {WIDTH} px window")
    is_chapter_with_diff = path.startswith("chapters/") and not path.startswith("chapters/ch01_")
    if is_chapter_with_diff and facts["diffFolds"] == 0:
        errors.append("no folded diff on a chapter page")
    if facts["openDiffFolds"]:
        errors.append(f"{facts['openDiffFolds']} diff folds open by default")
    name = path.strip("/").replace("/", "__") or "home"
    page.screenshot(path=str(SHOTS / f"{name}.png"))
    if facts["diffFolds"]:
        page.locator("details.chapter-diff").first.scroll_into_view_if_needed()
        page.evaluate("window.scrollBy(0, -400)")
        page.screenshot(path=str(SHOTS / f"{name}__diff.png"))
    page.close()
    print(
        f"{'ok  ' if not errors else 'FAIL'} /{path}  ({facts['images']} images, {facts['diffFolds']} diff folds, "
        f"{facts['scrollWidth']} px wide)",
        flush=True,
    )
    return errors


def check_site(site: Path) -> int:
    from playwright.sync_api import sync_playwright

    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    server, url = serve(site)
    failures = {}
    with tempfile.TemporaryDirectory(prefix="site-check-profile-") as profile, sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": WIDTH, "height": HEIGHT},
        )
        for path in site_pages(site):
            errors = check_page(context, url, path)
            if errors:
                failures[path] = errors
        context.close()
    server.shutdown()
    for path, errors in failures.items():
        print(f"\n/{path}:\n  " + "\n  ".join(errors))
    print(
        f"\n{len(site_pages(site)) - len(failures)} pages passed, {len(failures)} failed; "
        f"screenshots in {SHOTS.relative_to(ROOT)}/"
    )
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-build", action="store_true", help="check the site already built in build/site/")
    args = parser.parse_args()
    ensure_tools()
    if not args.no_build:
        build_site()
    sys.exit(check_site(SITE))


if __name__ == "__main__":
    main()
