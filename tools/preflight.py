"""Say, before anything slow runs, what `make test` needs that this machine lacks.

    python tools/preflight.py        exit 1, with the commands that install what is missing

`make test` needs, besides python3 (3.10 or newer):
- a Chromium for the static site's browser test: COURSE_CHROMIUM (a path), Debian's or
  Ubuntu's chromium, Google Chrome, or Playwright's own managed Chromium, in that order;
- npm, once, to fetch the site's JavaScript (MathJax, the widget manager) into build/vendor/.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR_SPEC = ROOT / "tools" / "vendor" / "package.json"
VENDOR_CACHE = ROOT / "build" / "vendor"
CANDIDATES = (
    "/usr/bin/chromium",
    "/usr/bin/chromium-browser",
    "/usr/bin/google-chrome",
    "/Applications/Chromium.app/Contents/MacOS/Chromium",
    "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome",
)
NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The Chromium (or Chrome) that the browser test drives, or None if there is none."""
    explicit = os.environ.get("COURSE_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for path in CANDIDATES:
        if Path(path).is_file():
            return path
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found
    return _playwright_chromium()


def _playwright_chromium() -> str | None:
    """The browser that `python -m playwright install chromium` downloaded, if any."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    try:
        with sync_playwright() as p:
            path = p.chromium.executable_path
    except Exception:  # no driver, or no browser downloaded
        return None
    return path if path and Path(path).is_file() else None


def vendor_cached() -> bool:
    """True if every npm package of tools/vendor/package.json is already in build/vendor/."""
    deps = json.loads(VENDOR_SPEC.read_text())["dependencies"]
    names = [f"{n.lstrip('@').replace('/', '-')}-{v}.tgz" for n, v in deps.items()]
    return all((VENDOR_CACHE / name).exists() for name in names)


def missing() -> list[str]:
    """What is missing, each with the commands that install it."""
    mac = platform.system() == "Darwin"
    found = []
    if sys.version_info < (3, 10):  # noqa: UP036 (this file runs before the venv exists)
        found.append(f"Python 3.10 or newer (this is {platform.python_version()})")
    if find_chromium() is None:
        how = (
            "brew install --cask chromium"
            if mac
            else "sudo apt-get install chromium   (Debian; Ubuntu: chromium-browser)"
        )
        found.append(
            "a Chromium for the site's browser test. Install one:\n"
            f"      {how}\n"
            "  or Playwright's own:  .venv/bin/python -m playwright install chromium\n"
            "  or name one:          export COURSE_CHROMIUM=/path/to/chrome"
        )
    if shutil.which("npm") is None and not vendor_cached():
        how = "brew install node" if mac else "sudo apt-get install npm"
        found.append(
            "npm, once, to fetch the site's MathJax and widget JavaScript into build/vendor/:\n"
            f"      {how}"
        )
    return found


def main() -> int:
    problems = missing()
    if not problems:
        print(f"preflight: Chromium at {find_chromium()}; site JavaScript available.")
        return 0
    print("make test needs what this machine lacks:", file=sys.stderr)
    for problem in problems:
        print(f"- {problem}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
