"""``python -m omni_dist_offload``: the ``omni-offload`` CLI (``generate`` by default)."""

import sys

from .app.cli import entry

if __name__ == "__main__":
    sys.exit(entry())
