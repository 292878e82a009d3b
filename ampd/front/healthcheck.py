"""`python -m ampd.front.healthcheck URL`: exit 0 when the front's /health answers 200 (compose's
healthcheck of the frontend service; the image has no curl or wget)."""
from __future__ import annotations

import sys
import urllib.request


def main(argv: list[str]) -> int:
    url = argv[0] if argv else "http://127.0.0.1:8000/health"
    try:
        with urllib.request.urlopen(url, timeout=4) as r:
            return 0 if r.status == 200 else 1
    except OSError as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
