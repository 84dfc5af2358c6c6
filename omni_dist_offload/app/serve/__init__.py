"""``omni-offload serve``: an offloaded pipeline kept warm behind an OpenAI-style HTTP API.

* :mod:`.service`: requests as slots, the wave queue, the loop that feeds the ranks; its flags;
* :mod:`.http`: the FastAPI app and its server (rank 0);
* :mod:`.guards`: auth, body limits, connection cap and deadlines, log and memory floods;
* :mod:`.errors`: errors in OpenAI's shape;
* :mod:`.jobs`: video jobs and their bounded store;
* :mod:`.metrics`: Prometheus metrics;
* :mod:`.run`: start-up and shutdown across the ranks.

``http``, ``guards``, ``errors``, ``metrics`` and ``run`` need the ``serve`` extra (fastapi, uvicorn, prometheus-client);
this package and ``service`` import without it, so the CLI can say what to install.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..api import Omni
from .service import ServeOptions, add_serve_flags, serve_options

__all__ = ["ServeOptions", "add_serve_flags", "run_serve", "serve_options"]


def run_serve(omni_factory: Callable[[], Omni], device: str | None, options: ServeOptions,
              setup: Mapping[str, Any] | None = None) -> int:
    """Join the ranks, check they were given the same ``setup``, build the pipeline with
    ``omni_factory()``, serve until SIGTERM."""
    # Imported here: run imports fastapi, uvicorn and prometheus_client, the optional serve extra
    # (serve_options has already checked they are installed).
    from .run import run_serve as run  # optional: the serve extra, see above

    return run(omni_factory, device, options, setup)
