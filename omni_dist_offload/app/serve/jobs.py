"""Video jobs (``/v1/videos``, OpenAI's video API): a job per request, answered at once and
polled; the finished video kept on disk for a while.

A job wraps one queued :class:`~.service.Job` (one slot). Its status follows the slot's future:
``queued`` until a rank takes it, ``in_progress`` while it runs (``progress`` counts the
denoising steps done: of the rank running it, or of rank 0 in a lockstep wave), then
``completed`` or ``failed``. The store is
bounded twice: by count (``--max-video-jobs``; a new job evicts the oldest finished one, and the
store refuses new jobs only when every kept job is still waiting or running) and by time (a
finished job expires ``--video-ttl`` seconds after it finished; its file goes with it). Files
live in a private temporary folder, removed when the service stops, so the server's memory stays
flat however many videos it keeps. A server killed outright (SIGKILL, the OOM killer) cannot
remove its folder; the next store to start removes every such folder left by a server that is
gone (each holds a lock file its server keeps locked while it lives).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .service import GenerationFailed, Job, ServiceUnavailable, SlotResult

__all__ = ["StoreFull", "VideoJob", "VideoStore", "write_whole"]

logger = logging.getLogger(__name__)

Status = Literal["queued", "in_progress", "completed", "failed"]


class StoreFull(RuntimeError):
    """Every kept job is still queued or running, and the store holds ``--max-video-jobs``."""


@dataclass(eq=False)
class VideoJob:
    """One ``POST /v1/videos``; read by the HTTP thread, finished by the generation thread."""

    id: str
    job: Job | None
    """The queued slot; None once the job finished (its future holds the encoded media, which
    the store keeps on disk only)."""
    model: str
    prompt: str
    size: str
    seconds: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, Any] | None = None
    media: Path | None = None
    thumbnail: Path | None = None

    @property
    def status(self) -> Status:
        return self._state()[0]

    def _state(self) -> tuple[Status, float]:
        job = self.job  # read once: the generation thread clears it as the job finishes
        if job is None or self.completed_at is not None:
            return ("failed" if self.error is not None else "completed"), 1.0
        return ("in_progress" if job.future.running() else "queued"), job.progress

    @property
    def finished(self) -> bool:
        return self.completed_at is not None

    def card(self) -> dict[str, Any]:
        """The job in OpenAI's ``video`` shape."""
        status, done = self._state()
        progress = 100 if status == "completed" else int(99 * done) if status == "in_progress" else 0
        return {"id": self.id, "object": "video", "model": self.model, "status": status,
                "progress": progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": self.expires_at, "size": self.size, "seconds": self.seconds,
                "prompt": self.prompt, "error": self.error, "remixed_from_video_id": None}


class VideoStore:
    """Video jobs by id, oldest first; thread-safe (HTTP thread and generation thread)."""

    def __init__(self, max_jobs: int, ttl_s: float, on_discarded: Any = None) -> None:
        self.max_jobs, self.ttl_s = max_jobs, ttl_s
        self._jobs: OrderedDict[str, VideoJob] = OrderedDict()
        self._lock = threading.Lock()
        _remove_stale_folders()
        self._folder = Path(tempfile.mkdtemp(prefix=_PREFIX))
        # Locked while this store lives (the kernel lets go when the process dies, however it
        # dies): a folder whose lock can be taken belongs to a server that is gone. The lock is
        # taken under another name and then renamed to _LOCK, so a store starting at the same
        # instant never finds this folder's _LOCK unlocked (it would take it for a dead server's).
        self._lock_file = open(self._folder / f"{_LOCK}.new", "xb")  # held until close()
        fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(self._folder / f"{_LOCK}.new", self._folder / _LOCK)
        # Called with the number of outputs generated for jobs deleted while they ran.
        self._on_discarded = on_discarded

    def __len__(self) -> int:
        return len(self._jobs)

    def has_room(self) -> bool:
        """Whether :meth:`add` would keep a new job (room, or a finished job to evict)."""
        with self._lock:
            self._sweep()
            return len(self._jobs) < self.max_jobs or any(j.finished for j in self._jobs.values())

    def add(self, job: Job, *, model: str, prompt: str, size: str, seconds: str) -> VideoJob:
        """Keep a new job; its future's outcome finishes it. Raises :class:`StoreFull`."""
        with self._lock:
            self._sweep()
            if len(self._jobs) >= self.max_jobs:
                oldest = next((j for j in self._jobs.values() if j.finished), None)
                if oldest is None:
                    raise StoreFull(f"{len(self._jobs)} video jobs are waiting or running (--max-video-jobs "
                                    f"{self.max_jobs}): retry later.")
                self._drop(oldest)
            video = VideoJob(id=f"video_{uuid.uuid4().hex}", job=job, model=model, prompt=prompt,
                             size=size, seconds=seconds)
            self._jobs[video.id] = video
        job.future.add_done_callback(lambda future: self._finish(video, future))
        return video

    def get(self, video_id: str) -> VideoJob | None:
        with self._lock:
            self._sweep()
            return self._jobs.get(video_id)

    def page(self, after: str | None, limit: int, order: str) -> tuple[list[VideoJob], bool]:
        """Up to ``limit`` jobs after the one with id ``after``, newest first for ``desc``;
        and whether more follow. ``KeyError`` if ``after`` is not kept."""
        with self._lock:
            self._sweep()
            jobs = list(self._jobs.values())
        if order == "desc":
            jobs.reverse()
        if after is not None:
            index = next((i for i, j in enumerate(jobs) if j.id == after), None)
            if index is None:
                raise KeyError(after)
            jobs = jobs[index + 1:]
        return jobs[:limit], len(jobs) > limit

    def delete(self, video_id: str) -> str | None:
        """Forget a job and its files; None if it is not kept. Returns ``"dropped"`` for a job
        taken out of the queue before it ran, ``"discarded"`` for one that runs on and whose
        output will be thrown away, ``"finished"`` otherwise."""
        with self._lock:
            video = self._jobs.get(video_id)
            if video is None:
                return None
            return self._drop(video)

    def close(self) -> None:
        """Remove every kept file (the service is stopping)."""
        with self._lock:
            self._jobs.clear()
            shutil.rmtree(self._folder, ignore_errors=True)
            self._lock_file.close()

    # -- internals (lock held) -------------------------------------------------------------
    def _drop(self, video: VideoJob) -> str:
        del self._jobs[video.id]
        for path in (video.media, video.thumbnail):
            if path is not None:
                path.unlink(missing_ok=True)
        if video.finished or video.job is None:
            return "finished"
        # A queued slot leaves the queue at once (see WaveQueue) and never runs; a running one
        # cannot be stopped.
        return "dropped" if video.job.future.cancel() else "discarded"

    def _sweep(self) -> None:
        now = time.time()
        for video in [j for j in self._jobs.values() if j.expires_at is not None and j.expires_at <= now]:
            self._drop(video)

    def _finish(self, video: VideoJob, future: concurrent.futures.Future) -> None:
        """The slot's outcome (in the generation thread, or at once if it was cancelled)."""
        if future.cancelled():
            return  # deleted (or evicted) while queued: nothing ran
        media = thumbnail = None
        error = None
        exc = future.exception()
        if exc is None:
            result: SlotResult = future.result()
            try:
                media = self._folder / f"{video.id}{result.suffix}"
                write_whole(media, result.media)
                if result.thumbnail:
                    thumbnail = self._folder / f"{video.id}.png"
                    write_whole(thumbnail, result.thumbnail)
            except OSError as write_error:  # a full disk, a folder removed under the server
                # The job fails (it stayed "queued" for good when this raised in the callback).
                logger.warning("video job %s: storing its video failed: %s", video.id, write_error)
                for path in (media, thumbnail):
                    if path is not None:
                        path.unlink(missing_ok=True)
                media = thumbnail = None
                error = {"code": "output_write_failed",
                         "message": f"the video of {video.id} was generated but storing it on the server "
                                    f"failed; the server's log has the reason."}
        elif isinstance(exc, ServiceUnavailable):
            error = {"code": "shutting_down", "message": str(exc)}
        else:
            # The reason (an exception's text) stays in the server's log: it may hold internals.
            if not isinstance(exc, GenerationFailed):
                logger.warning("video job %s failed: %s: %s", video.id, type(exc).__name__, exc)
            error = {"code": "generation_failed",
                     "message": f"generation failed for {video.id}; the server's log has the reason."}
        with self._lock:
            kept = self._jobs.get(video.id) is video
            if kept:
                video.media, video.thumbnail, video.error = media, thumbnail, error
                video.completed_at = int(time.time())
                video.expires_at = int(video.completed_at + self.ttl_s)
                # Last: the slot's future holds the encoded video, which is on disk now. Kept,
                # every finished job would hold its video in memory too.
                video.job = None
        if not kept:  # deleted while it ran: the output goes
            for path in (media, thumbnail):
                if path is not None:
                    path.unlink(missing_ok=True)
            if exc is None and self._on_discarded is not None:
                self._on_discarded(1)


_PREFIX = "omni-serve-videos-"
_LOCK = ".lock"


def _remove_stale_folders() -> None:
    """Remove the video folders of stores whose server is gone: this user's, with a lock file
    that can be locked. A folder without one, or another user's, is left alone."""
    try:
        folders = list(Path(tempfile.gettempdir()).glob(f"{_PREFIX}*"))
    except OSError:
        return
    for folder in folders:
        try:
            if not folder.is_dir() or folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
            with open(folder / _LOCK, "rb") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its server lives
                shutil.rmtree(folder, ignore_errors=True)
                logger.info("removed %s, left by a server that is gone", folder)
        except OSError:
            continue


def write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole under a temporary name, then rename it: a download never
    sees half a file, and a failure (a full disk) leaves none."""
    tmp = path.with_name(f".{path.name}.part")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

