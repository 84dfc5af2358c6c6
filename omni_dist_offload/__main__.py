"""``python -m omni_dist_offload`` and the ``omni-offload`` script: the CLI (``generate`` by
default), started the way its command needs.

[Note: serve on the C allocator]
A long-running server must give back the memory of a flood of connections once it has passed.
Python's small-object allocator cannot: a few objects left in each of its 1 MiB arenas keep them
all (measured: 10,000 stalled uploads left ~55 MiB behind for good). On the C allocator,
``malloc_trim`` after the flood returns it to within 1%. So ``serve`` restarts itself with
``PYTHONMALLOC=malloc`` before torch or diffusers are imported (this module and the package's
``__init__`` import neither). Generation runs on the accelerator, where slower small allocations
cost nothing measurable. ``PYTHONMALLOC`` set to anything keeps the process as it is
(``PYTHONMALLOC=pymalloc`` for Python's own).
"""

import logging
import os
import sys

from .runtime.proc import skip_final_collection


def run() -> int:
    args = sys.argv[1:]
    if args[:1] == ["serve"] and "PYTHONMALLOC" not in os.environ and os.name == "posix":
        os.environ["PYTHONMALLOC"] = "malloc"
        try:
            os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
        except OSError as exc:  # the process goes on as it is
            logging.getLogger(__name__).warning("could not restart on the C allocator (%s); serving on "
                                                "Python's", exc)
    from .app.cli import main  # after the restart: it imports torch and diffusers

    try:
        return main(args)
    finally:
        skip_final_collection()  # [Note: exit without the final collection]


if __name__ == "__main__":
    sys.exit(run())
