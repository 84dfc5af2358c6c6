"""``omni-offload serve`` for tests: a real server (one rank as a command or forked, several
as forked ranks), HTTP calls on loopback (urllib), decoding, Prometheus samples, and the reference
images ``Omni.generate`` makes in the test's process."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from omni_dist_offload import Omni
from omni_dist_offload.tools.serve_stress import SERVING_LINE
from ranks import start_forked, start_ranks

IMAGES = "/v1/images/generations"
VIDEOS = "/v1/videos/generations"
CONFIG = '{"mode":"layer","components":["dit","text_encoder"]}'


def call(port: int, path: str, body: object | bytes | None = None,
         timeout: float = 120, content_type: str = "application/json") -> tuple[int, dict | str]:
    """``POST`` JSON (or raw bytes, sent as ``content_type``) when ``body`` is given, else ``GET``;
    (status, parsed body)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": content_type} if data is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    return status, (text if path == "/metrics" else json.loads(text))


def decode(item: dict) -> np.ndarray:
    """A response item's media as ``(frames, height, width, 3)`` uint8."""
    raw = base64.b64decode(item["b64_json"]) if "b64_json" in item else Path(item["path"]).read_bytes()
    if item["format"] == "mp4":
        import imageio.v2 as imageio

        return np.stack(imageio.mimread(io.BytesIO(raw), format="mp4"))
    with Image.open(io.BytesIO(raw)) as image:
        frames = []
        for i in range(getattr(image, "n_frames", 1)):
            image.seek(i)
            frames.append(np.asarray(image.convert("RGB")))
    return np.stack(frames)


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of the Prometheus text; 0 when absent."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.match(r"^([a-z_]+)(?:\{(.*)\})? (\S+)$", line)
        if match and match[1] == name and ",".join(sorted((match[2] or "").split(","))) == wanted:
            return float(match[3])
    return 0.0


class Server:
    """``omni-offload serve``: one rank as a command of its own, or forked from the tests'
    preloaded server (``fork=True``: the same CLI, started without seconds of imports); several
    ranks forked as torchrun would start them (tests/ranks.py). It binds a free port itself
    (``--port 0``) and says which: a port picked here and passed on could be taken by another
    process first, and its answers taken for this server's."""

    def __init__(self, tmp: Path, model: str, *flags: str, ranks: int = 1, max_files: int | None = None,
                 prelude: str | None = None, fork: bool = False) -> None:
        """``max_files``: the server's open-file limit, soft and hard. ``prelude``: Python run in
        the server's process before the CLI (one rank), to patch what a test needs; that process
        starts on the C allocator (``PYTHONMALLOC=malloc``), so the CLI does not restart it (and
        run the prelude, and its imports, twice). A forked server runs on the allocator of the
        process it is forked from (``PYTHONMALLOC=pymalloc``, said so to the CLI)."""
        self.port = 0
        self.out_dir = tmp / "out"
        self.job = None
        serve = ["serve", "--model", model, "--diffusion-offload-config", CONFIG, "--port", "0",
                 "--output-dir", str(self.out_dir), "--video-format", "gif", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LOG_RANK": "0,1"}
        assert prelude is None or ranks == 1, "a prelude runs in a one-rank server only"
        self.log = (tmp / "server.log").open("w+")
        if ranks > 1:
            self.job = start_ranks(serve_on_rank, ranks, args=(serve,),
                                   env={"LOG_RANK": "0,1", "PYTHONMALLOC": "pymalloc"}, broken_group=True)
            self.pids = self.job.pids
        elif fork:
            self.proc = start_forked(serve_command, (serve, prelude), env={**env, "PYTHONMALLOC": "pymalloc"},
                                     log=Path(self.log.name), cwd=tmp, max_files=max_files)
            self.pids = [self.proc.pid]
        else:
            cli = ["-m", "omni_dist_offload", *serve]
            if prelude is not None:
                cli = ["-c", f"{prelude}\nimport sys\nfrom omni_dist_offload.__main__ import run\nsys.exit(run())",
                       *serve]
                env["PYTHONMALLOC"] = "malloc"
            self.proc = subprocess.Popen([sys.executable, *cli], cwd=tmp, env=env, stdout=self.log,
                                         stderr=subprocess.STDOUT,
                                         preexec_fn=None if max_files is None else lambda: _limit_files(max_files))
            self.pids = [self.proc.pid]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.running(), self.output()
            if not self.port and (match := SERVING_LINE.search(self.output())):
                self.port = int(match[1])
            try:
                if self.port and call(self.port, "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server did not come up:\n{self.output()}")

    def running(self) -> bool:
        """Every process of the server still running."""
        if self.job is not None:
            return all(proc.is_alive() for proc in self.job.procs)
        return self.proc.poll() is None

    def output(self) -> str:
        """What the server printed: each rank's output in turn."""
        if self.job is not None:
            return "".join(self.job.output(rank) for rank in range(len(self.job.procs)))
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text()

    def terminate(self, pid: int | None = None) -> int:
        """SIGTERM (to ``pid``, default rank 0) and the exit status: of every rank, the first
        that is not 0."""
        os.kill(pid or self.pids[0], signal.SIGTERM)
        if self.job is not None:
            codes = self.job.wait(60)
            return next((code for code in codes if code != 0), 0)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.log.close()

    def kill(self) -> None:
        if self.job is not None:
            self.job.stop()
        elif self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def serve_command(serve: list[str], prelude: str | None) -> int:
    """A forked one-rank server: the prelude, then the CLI as ``python -m omni_dist_offload``."""
    if prelude is not None:
        exec(compile(prelude, "<prelude>", "exec"), {"__name__": "__prelude__"})
    from omni_dist_offload.__main__ import run

    sys.argv = ["omni-offload", *serve]
    return run()


def serve_on_rank(rank, serve: list[str]) -> int:
    """One rank of a forked server (its process group already up: the CLI joins it)."""
    from omni_dist_offload.__main__ import run

    sys.argv = ["omni-offload", *serve]
    return run()


def _limit_files(count: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (count, count))


def reference(model: str, seeds: list[int], **options) -> list[np.ndarray]:
    """``Omni.generate`` in this process, with the server's thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Omni(model, CONFIG, progress=False) as omni:
            outs = [omni.generate("a red fox", seed=s, **options).frames for s in seeds]
    finally:
        torch.set_num_threads(threads)
    return [o if o.ndim == 4 else o[None] for o in outs]
