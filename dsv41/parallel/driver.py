"""Rank 0 drives the model; every other rank follows it, call for call.

Under tensor and expert parallelism the model's layers run collectives inside forward, logits and the
DSpark draft, so every rank must make the same model calls, in the same order, with the same arguments.
Only rank 0 tokenises, schedules (the engine), samples, prints and serves:

- `Driver` is rank 0's end of the control group (`ParallelContext.control_group`, gloo on the CPU): it
  broadcasts commands, sends heartbeats while none is running, and turns a lost peer into one
  `RankLostError`.
- `DriverModel` is the model the engine sees on rank 0 (engine/protocol.py's `ModelInterface`). Each
  call the engine makes — and each mutating call on the cache it hands out (`DriverCache`) — is first
  broadcast as a small command (step metadata as tuples, token ids as CPU tensors), then run on rank
  0's own part of the model.
- `follow` is the loop of the other ranks: it takes each command and runs it on its own part of the
  model with its own caches, until rank 0 says stop.

Activations never travel. The engine hands a forward's output back whole with the rows it wants
(`logits(out.hidden, rows=picks)`, `dspark_observe(out.dspark_hidden, step, cache, rows=picks)`, the
protocol's explicit form), so only the row numbers are sent and every rank picks the same rows of its
own copy of that output. (Any other tensor is sent whole.)

DSpark drafting calls `choose` (rank 0's sampler) once per draft position; rank 0 broadcasts each
choice and the followers' `choose` receives it, so only rank 0 samples.

Liveness, as measured with torch 2.13's gloo: a broadcast waits at most its group's timeout
(ctx.timeout_s) and then fails — on the receiving side when nothing was sent, and equally on the
sending side, since gloo hands data over only once the receiver has posted its receive — and it fails at
once ("Connection closed by peer") when a peer has died. While rank 0 runs no command (a chat user
typing, an idle server) a heartbeat thread sends a no-op every few seconds, so a follower that hears
nothing for the timeout knows rank 0 is gone or stuck. One lock, held for the whole of each command
(its own messages included), keeps heartbeats out of a command.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ..errors import InputError, RankLostError, UserError
from .context import ParallelContext

HEARTBEAT_S = 2.0
"""The longest rank 0 stays silent between commands (a quarter of the timeout when that is shorter)."""

# What gloo (and NCCL) say when a collective fails because a peer died or stopped answering.
_LOST_SIGNS = ("connection closed", "connection reset", "connection refused", "broken pipe", "timed out",
               "timeout")

# Command names (the first element of every command tuple).
HEARTBEAT, STOP, LOAD, RELEASE = "heartbeat", "stop", "load", "release"
NEW_CACHE, FORWARD, LOGITS, OBSERVE, DRAFT = "new_cache", "forward", "logits", "observe", "draft"
SNAPSHOT, ROLLBACK, RESET = "snapshot", "rollback", "reset"


# ------------------------------------------------------------------------------------ lost peers
def peer_failure(exc: BaseException) -> bool:
    """Whether a failed collective means a peer died or stopped answering (not a bug of the call)."""
    if isinstance(exc, RankLostError):
        return True
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(sign in str(exc).lower() for sign in _LOST_SIGNS)


def _peer(ctx: ParallelContext) -> str:
    """The peer a failure on this rank points at: gloo names only an address, so a rank is known only
    in a world of two."""
    return f"rank {1 - ctx.rank}" if ctx.world_size == 2 else "a peer"


def lost(ctx: ParallelContext, doing: str, exc: BaseException) -> RankLostError:
    """One line for a collective that failed for a lost peer: this rank, the peer, what it was doing."""
    if isinstance(exc, RankLostError):
        return exc
    text = str(exc).lower()
    if "timed out" in text or "timeout" in text:
        return RankLostError(f"rank {ctx.rank}: {_peer(ctx)} did not answer for {ctx.timeout_s:g} s {doing}")
    return RankLostError(f"rank {ctx.rank}: {_peer(ctx)} closed its connection {doing}")


def _broadcast(ctx: ParallelContext, message: Any = None) -> Any:
    """Rank 0's message to every rank (the others pass nothing and get it)."""
    box = [message]
    dist.broadcast_object_list(box, src=0, group=ctx.control_group)
    return box[0]


def _receive(ctx: ParallelContext, doing: str) -> Any:
    """A follower's next message from rank 0; a silence past the timeout or a closed peer is an error."""
    try:
        return _broadcast(ctx)
    except Exception as e:
        if not peer_failure(e):
            raise
        text = str(e).lower()
        if "timed out" in text or "timeout" in text:
            raise RankLostError(f"rank {ctx.rank}: rank 0 stopped sending commands for {ctx.timeout_s:g} s "
                                f"({doing})") from None
        raise lost(ctx, f"while {doing}", e) from None


# ------------------------------------------------------------------------------------ rank 0: the channel
class Driver:
    """Rank 0's end of the control group: commands under a lock, heartbeats between them.

    `on_lost(error)` is called once, from whichever thread finds a peer lost first (the heartbeat thread
    finds it while rank 0 is idle, when no call of rank 0's would); the error is raised afterwards to
    whoever sends next. Use as a context manager: leaving it tells the followers to stop.
    """

    def __init__(self, ctx: ParallelContext, on_lost: Callable[[RankLostError], None] | None = None,
                 heartbeat_s: float = HEARTBEAT_S):
        if not ctx.is_driver or not ctx.distributed:
            raise ValueError(f"a Driver runs on rank 0 of a parallel run, not on {ctx.describe()}")
        self.ctx, self.on_lost = ctx, on_lost
        self.interval = min(heartbeat_s, ctx.timeout_s / 4)
        self._lock = threading.Lock()
        self._lost: RankLostError | None = None
        self._closed = False
        self._last_sent = time.monotonic()
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="dsv41-heartbeat", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------------- commands
    @contextmanager
    def command(self, message: tuple, doing: str):
        """Send a command and hold the channel while the body runs it on rank 0 (a lost peer in the
        body's collectives is reported as one too)."""
        with self._lock:
            self._check_open()
            try:
                self._send(message)
                yield
            except Exception as e:
                if peer_failure(e):
                    raise self._lose(e, f"during {doing}") from None
                raise

    def send(self, message: Any) -> None:
        """A further message inside a running command (a draft's choices)."""
        self._send(message)

    def load(self, order: Any, loader: Callable[[], Any]) -> "DriverModel":
        """Tell the followers to load (`order` is what they need: `await_load` hands it to them) and load
        rank 0's part meanwhile. No heartbeat runs during the load, when the followers are not listening."""
        with self.command((LOAD, order), "the model load"):
            model = loader()
        return DriverModel(model, self)

    def stop(self) -> None:
        """Tell the followers to return; the channel is closed afterwards (a second stop does nothing)."""
        if self._closed and self._lost is None:
            return
        try:
            with self.command((STOP,), "the stop"):
                self._closed = True
        finally:
            self._closed = True
            self._quit.set()
            self._thread.join()

    def __enter__(self) -> "Driver":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if exc is None:
            self.stop()
            return
        self.on_lost = None                    # rank 0 failed: that error is the one to report …
        try:
            self.stop()                        # … after stopping the followers that still listen
        except Exception:
            pass

    # ---------------------------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self._lost is not None:
            raise self._lost
        if self._closed:
            raise InputError("the parallel driver has stopped: its followers take no more commands")

    def _send(self, message: Any) -> None:
        _broadcast(self.ctx, message)
        self._last_sent = time.monotonic()

    def _lose(self, exc: BaseException, doing: str) -> RankLostError:
        """Record the first loss and report it (callers hold the lock)."""
        if self._lost is None:
            self._lost = lost(self.ctx, doing, exc)
            if self.on_lost is not None:
                self.on_lost(self._lost)
        return self._lost

    def _beat(self) -> None:
        """The heartbeat thread: a no-op whenever rank 0 has sent nothing for `interval` seconds."""
        while not self._quit.wait(self.interval / 2):
            with self._lock:
                if self._closed or self._lost is not None:
                    return
                if time.monotonic() - self._last_sent < self.interval:
                    continue
                try:
                    self._send((HEARTBEAT,))
                except Exception as e:         # nothing else uses the channel now: any failure ends it
                    self._lose(e, "between commands")
                    return


# ------------------------------------------------------------------------------------ rank 0: the model
def _argument(given: torch.Tensor, last: torch.Tensor | None, rows) -> tuple:
    """What the followers need for a tensor the engine hands back: ("last", rows) for the last forward's
    own output (each rank has its copy), else ("data", the tensor on the CPU, rows)."""
    rows = None if rows is None else [int(r) for r in rows]
    if last is not None and given is last:
        return "last", rows
    return "data", given.detach().cpu(), rows


def _where(step) -> Any:
    """A Step as the tuples every rank rebuilds it from (an int start position passes as it is)."""
    if isinstance(step, int):
        return step
    return tuple(step.slots), tuple(step.starts), tuple(step.counts)


def _on_cpu(images):
    return tuple(t.detach().cpu() for t in (images.index, images.rows, images.types))


def _on_device(spans: tuple, device):
    from ..vision.spans import SpanRows

    return SpanRows(*(t.to(device) for t in spans))


def _argmax(row_logits: torch.Tensor) -> torch.Tensor:
    return row_logits.argmax(-1)


class DriverModel:
    """The model on rank 0, as the engine sees it: every call is a command the followers run too."""

    def __init__(self, model, driver: Driver):
        self.model, self.driver = model, driver
        self.cfg, self.runtime = model.cfg, model.runtime
        self._last = None
        """The last forward's output: the engine hands its tensors back with the rows it wants."""
        self._next_cache = 0
        self._released: deque[int] = deque()
        """Ids of caches the engine dropped; the followers drop theirs with the next command."""

    @property
    def device(self) -> torch.device:
        return self.model.device

    @contextmanager
    def _command(self, message: tuple, doing: str):
        """A command, after telling the followers which caches the engine dropped (so that a new cache
        does not sit beside the one it replaces)."""
        released = []
        while self._released:
            released.append(self._released.popleft())
        if released:
            with self.driver.command((RELEASE, tuple(released)), "releasing caches"):
                pass
        with self.driver.command(message, doing):
            yield

    # ---------------------------------------------------------------------------------- the protocol
    def step(self, slots, starts, counts):
        """Metadata only: each rank builds its own from the tuples a command carries."""
        return self.model.step(slots, starts, counts)

    def new_cache(self, n_slots: int, max_seq_len: int) -> "DriverCache":
        cid, self._next_cache = self._next_cache, self._next_cache + 1
        with self._command((NEW_CACHE, cid, n_slots, max_seq_len), "making a cache"):
            cache = DriverCache(self, self.model.new_cache(n_slots, max_seq_len), cid)
        weakref.finalize(cache, self._released.append, cid)
        return cache

    def __call__(self, ids: torch.Tensor, step, cache: "DriverCache", *, images=None):
        local = self._local(cache)
        self._last = None                                # the last output's memory, before the next one
        spans = None if images is None else _on_cpu(images)
        with self._command((FORWARD, cache.id, ids.detach().cpu(), _where(step), spans), "forward"):
            self._last = self.model(ids, step, local, images=images)
        return self._last

    def encode_image(self, image):
        """Rank 0 alone: the vision encoder is whole on every rank, and the span rows travel with the
        forward that feeds them."""
        return self.model.encode_image(image)

    def logits(self, hidden: torch.Tensor, rows=None) -> torch.Tensor:
        argument = _argument(hidden, None if self._last is None else self._last.hidden, rows)
        with self._command((LOGITS, argument), "logits"):
            return self.model.logits(hidden, rows=rows)

    def dspark_observe(self, dspark_hidden: torch.Tensor, step, cache: "DriverCache", *, rows=None) -> None:
        local = self._local(cache)
        argument = _argument(dspark_hidden, None if self._last is None else self._last.dspark_hidden, rows)
        with self._command((OBSERVE, cache.id, argument, _where(step)), "DSpark observe"):
            self.model.dspark_observe(dspark_hidden, step, local, rows=rows)

    def dspark_draft(self, token: torch.Tensor, last_pos, cache: "DriverCache", choose=None, *, slots=None):
        local, sampler = self._local(cache), choose or _argmax

        def relay(row_logits: torch.Tensor) -> torch.Tensor:
            chosen = sampler(row_logits)
            self.driver.send(chosen.detach().cpu())
            return chosen

        slots = None if slots is None else tuple(slots)
        last = last_pos if isinstance(last_pos, int) else tuple(last_pos)
        with self._command((DRAFT, cache.id, token.detach().cpu(), last, slots), "DSpark draft"):
            return self.model.dspark_draft(token, last_pos, local, relay, slots=slots)

    def _local(self, cache) -> Any:
        if not isinstance(cache, DriverCache) or cache.owner is not self:
            raise InputError(f"a parallel model needs a cache from its own new_cache(...), got {type(cache).__name__}")
        return cache.local


class DriverCache:
    """Rank 0's cache, whose mutating calls are commands; reads go to rank 0's own cache."""

    READS = frozenset({"check", "n_slots", "max_seq_len", "lengths", "length", "batch_size"})

    def __init__(self, owner: DriverModel, local, cid: int):
        self.owner, self.local, self.id = owner, local, cid
        self._snapshot = None

    def snapshot(self, step):
        with self.owner._command((SNAPSHOT, self.id, _where(step)), "cache snapshot"):
            self._snapshot = self.local.snapshot(step)
        return self._snapshot

    def rollback(self, snap, keep) -> None:
        if snap is not self._snapshot or snap is None:
            raise InputError("a parallel cache rolls back to its latest snapshot only (the followers keep that one)")
        with self.owner._command((ROLLBACK, self.id, tuple(keep)), "cache rollback"):
            self.local.rollback(snap, keep)
        self._snapshot = None

    def reset(self, slot: int | None = None) -> None:
        with self.owner._command((RESET, self.id, slot), "cache reset"):
            self.local.reset(slot)

    def __getattr__(self, name: str):
        if name in DriverCache.READS:
            return getattr(self.local, name)
        raise AttributeError(f"a parallel cache offers {sorted(DriverCache.READS)} and snapshot, rollback, reset; "
                             f"{name!r} would change rank 0's cache alone")


# ------------------------------------------------------------------------------------ the other ranks
class _Interrupted(Exception):
    """Rank 0 left a command half-way (its sampler failed mid-draft) and sent this message next."""

    def __init__(self, message: Any):
        super().__init__("rank 0 abandoned a command")
        self.message = message


def await_load(ctx: ParallelContext) -> Any:
    """A follower's wait for rank 0's load order (→ the order), or for a stop before any load (→ None:
    rank 0 failed or had nothing to run)."""
    while True:
        message = _receive(ctx, "waiting for rank 0 to load the model")
        if message[0] == LOAD:
            return message[1]
        if message[0] == STOP:
            return None
        if message[0] != HEARTBEAT:
            raise RuntimeError(f"rank {ctx.rank}: rank 0 sent {message[0]!r} before loading the model")


def follow(model, ctx: ParallelContext) -> None:
    """Run rank 0's commands on this rank's part of the model until rank 0 says stop."""
    _Follower(model, ctx).run()


class _Followed:
    """A follower's cache and the snapshot it may roll back to."""

    def __init__(self, cache):
        self.cache, self.snapshot = cache, None


class _Follower:
    def __init__(self, model, ctx: ParallelContext):
        self.model, self.ctx = model, ctx
        self.caches: dict[int, _Followed] = {}
        self.output: Any = None
        self.handlers = {NEW_CACHE: self._new_cache, RELEASE: self._release, FORWARD: self._forward,
                         LOGITS: self._logits, OBSERVE: self._observe, DRAFT: self._draft,
                         SNAPSHOT: self._snapshot, ROLLBACK: self._rollback, RESET: self._reset}

    def run(self) -> None:
        message = None
        while True:
            if message is None:
                message = _receive(self.ctx, "waiting for a command")
            if message[0] == STOP:
                return
            try:
                self._execute(message)
                message = None
            except _Interrupted as interrupted:
                message = interrupted.message

    @torch.inference_mode()
    def _execute(self, message: tuple) -> None:
        """Run one command. An input error is rank 0's too (it ran the same call), so it is left to rank 0
        to report; anything else stops this rank, which rank 0 then sees as a lost peer."""
        op, args = message[0], message[1:]
        if op == HEARTBEAT:
            return
        handler = self.handlers.get(op)
        if handler is None:
            raise RuntimeError(f"rank {self.ctx.rank}: unknown command {op!r} from rank 0")
        try:
            handler(*args)
        except (_Interrupted, RankLostError):
            raise
        except UserError:
            pass
        except Exception as e:
            if peer_failure(e):
                raise lost(self.ctx, f"during {op}", e) from None
            raise

    # ---------------------------------------------------------------------------------- commands
    def _step(self, where):
        return where if isinstance(where, int) else self.model.step(*where)

    def _new_cache(self, cid: int, n_slots: int, max_seq_len: int) -> None:
        self.caches[cid] = _Followed(self.model.new_cache(n_slots, max_seq_len))

    def _release(self, cids: tuple[int, ...]) -> None:
        for cid in cids:
            self.caches.pop(cid, None)

    def _forward(self, cid: int, ids: torch.Tensor, where, spans=None) -> None:
        self.output = None                               # the last output's memory, before the next one
        images = None if spans is None else _on_device(spans, self.model.device)
        self.output = self.model(ids.to(self.model.device), self._step(where), self.caches[cid].cache, images=images)

    def _tensor(self, argument: tuple, field: str) -> tuple[torch.Tensor, list[int] | None]:
        """(tensor, rows) an argument stands for on this rank: its own copy of the last output, or data."""
        if argument[0] == "last":
            return getattr(self.output, field), argument[1]
        return argument[1].to(self.model.device), argument[2]

    def _logits(self, argument) -> None:
        hidden, rows = self._tensor(argument, "hidden")
        self.model.logits(hidden, rows=rows)

    def _observe(self, cid: int, argument, where) -> None:
        hidden, rows = self._tensor(argument, "dspark_hidden")
        self.model.dspark_observe(hidden, self._step(where), self.caches[cid].cache, rows=rows)

    def _draft(self, cid: int, token: torch.Tensor, last_pos, slots) -> None:
        self.model.dspark_draft(token.to(self.model.device), last_pos, self.caches[cid].cache, self._chosen,
                                slots=slots)

    def _chosen(self, row_logits: torch.Tensor) -> torch.Tensor:
        """The followers' `choose`: rank 0's choice for this draft position."""
        message = _receive(self.ctx, "waiting for rank 0's draft choice")
        if not isinstance(message, torch.Tensor):
            raise _Interrupted(message)
        return message.to(row_logits.device)

    def _snapshot(self, cid: int, where) -> None:
        held = self.caches[cid]
        held.snapshot = None
        held.snapshot = held.cache.snapshot(self._step(where))

    def _rollback(self, cid: int, keep: tuple[int, ...]) -> None:
        held = self.caches[cid]
        snap, held.snapshot = held.snapshot, None
        held.cache.rollback(snap, list(keep))

    def _reset(self, cid: int, slot: int | None) -> None:
        self.caches[cid].cache.reset(slot)
