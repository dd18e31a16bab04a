"""AsyncLLM: the engine loop on a background thread, streaming delta outputs to asyncio callers.

One thread owns the `LLMEngine` (it is not thread-safe). Between two steps it drains an inbox of
new requests and aborts, so requests join the running batch at any step (continuous batching).
Each step's outputs go to the callers' event loops in one `call_soon_threadsafe` per loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.arg_utils import DEFAULT_MAX_QUEUED_REQUESTS, AsyncEngineArgs
from jaxserve.engine.core import EngineDeadError
from jaxserve.engine.stats import EngineStats
from jaxserve.engine.input_processor import PromptType, refuse_lora
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.models.tokenizer import Tokenizer
from jaxserve.outputs import (CompletionOutput, PoolingOutput, PoolingRequestOutput,
                              RequestMetrics, RequestOutput, accumulate)
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")
_IDLE_WAIT_S = 0.01  # a stalled schedule (nothing admitted, nothing running) polls this often


class EngineQueueFullError(RuntimeError):
    """Too many requests are already waiting for the engine; retry later (HTTP 503)."""


class EngineStepError(RuntimeError):
    """The step carrying this request failed; the engine goes on serving (HTTP 500)."""


@dataclass(slots=True)
class AsyncLLMStats:
    engine: EngineStats  # snapshot taken by the engine thread after its latest step
    num_unfinished: int  # accepted by generate() and not yet finished or aborted
    num_queued: int  # samples (n per request) accepted and not running in the engine yet
    num_steps: int
    num_join_steps: int  # steps where a request got its first token while others decoded
    num_joined_requests: int  # requests whose first token came in such a step
    num_prompt_tokens: int  # of requests that produced a first token
    num_generation_tokens: int
    step_seconds: float  # wall time spent inside engine.step


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams | None
    arrival_time: float
    priority: int
    cache_salt: str | None
    future: concurrent.futures.Future


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]
    notify: bool  # send the stream a final "abort" output (the caller did not go away)


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    samples: int  # n


_SHUTDOWN = object()


class AsyncLLM:
    def __init__(self, model: str, max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
                 **engine_args: Any):
        _check_queue_bound(max_queued_requests)
        self._start(LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args)),
                    max_queued_requests)

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs | None = None,
                         **kwargs: Any) -> "AsyncLLM":
        """As vLLM: `AsyncLLM.from_engine_args(AsyncEngineArgs(model=...))`; or the
        arguments themselves (`from_engine_args(model=..., max_queued_requests=...)`)."""
        args = AsyncEngineArgs.of(engine_args, kwargs)
        return cls.from_engine(LLMEngine(args.create_engine_config()), args.max_queued_requests)

    @classmethod
    def from_engine(cls, engine: LLMEngine,
                    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS) -> "AsyncLLM":
        """Wrap an engine nobody else will call again (its thread becomes the only user)."""
        self = cls.__new__(cls)
        self._start(engine, max_queued_requests)
        return self

    def _start(self, engine: LLMEngine, max_queued_requests: int) -> None:
        _check_queue_bound(max_queued_requests)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.core.max_model_len
        self.max_queued_requests = max_queued_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._num_samples = 0  # summed over the streams: what max_queued_requests bounds
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._closed = False  # set (under the lock) when the engine thread stops reading
        self._lock = threading.Lock()
        # Written by the engine thread only; plain attribute reads elsewhere are safe.
        self._engine_stats = engine.stats()
        self._started: set[str] = set()  # request ids that have produced a token
        self._num_steps = self._num_join_steps = self._num_joined = 0
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._step_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any event loop) ------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, arrival_time: float | None = None,
                       priority: int = 0, cache_salt: str | None = None,
                       lora_request: object | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs of `sampling_params.output_kind` (as vLLM: CUMULATIVE by default,
        DELTA, or FINAL_ONLY); the last has `finished=True`. Bad input raises ValueError
        before any output; leaving the loop early (cancel, break, aclose) aborts the request.

        Non-final outputs carry a snapshot of the metrics without `token_times` (the delta's
        tokens all came at `last_token_time`); the final output has the full metrics.
        """
        refuse_lora(lora_request)
        if self.engine.pooling:
            raise ValueError("generate needs a generative model: this engine was started with "
                             "runner='pooling' (use encode)")
        if sampling_params is not None:  # a request that can never run is not "busy": 400
            self.engine.input_processor.check_params(sampling_params)
        kind = RequestOutputKind.CUMULATIVE if sampling_params is None \
            else sampling_params.output_kind
        async with contextlib.aclosing(self._stream(
                prompt, sampling_params, request_id, kind, arrival_time, priority,
                cache_salt)) as outputs:
            async for out in outputs:
                yield out

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, *, arrival_time: float | None = None,
                     priority: int = 0, lora_request: object | None = None,
                     ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling engine's (runner="pooling") request: its one output, finished. Bad input
        raises ValueError before it."""
        refuse_lora(lora_request)
        if not self.engine.pooling:
            raise ValueError("encode needs a pooling model: start the engine with "
                             "runner='pooling'")
        params = dataclasses.replace(pooling_params or PoolingParams())
        params.verify(params.task or "embed")
        async with contextlib.aclosing(self._stream(
                prompt, params, request_id, RequestOutputKind.FINAL_ONLY, arrival_time,
                priority, None)) as outputs:
            async for out in outputs:
                yield out

    async def _stream(self, prompt: PromptType, params: SamplingParams | PoolingParams | None,
                      request_id: str | None, kind: RequestOutputKind,
                      arrival_time: float | None, priority: int, cache_salt: str | None,
                      ) -> AsyncIterator[Any]:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._error!r}")
        if request_id is None:
            request_id = f"async-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        samples = params.n if isinstance(params, SamplingParams) else 1
        if self.num_queued + samples > self.max_queued_requests:
            raise EngineQueueFullError(f"{self.num_queued} samples are already waiting "
                                       f"(max_queued_requests={self.max_queued_requests})")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), samples)
        self._streams[request_id] = stream
        self._num_samples += samples
        added = concurrent.futures.Future()
        try:
            self._submit(_Add(request_id, prompt, params,
                              time.time() if arrival_time is None else arrival_time,
                              priority, cache_salt, added))
        except EngineDeadError:
            self._drop_stream(request_id, stream)
            raise
        finished = rejected = False
        total: RequestOutput | None = None
        try:
            try:
                await asyncio.wrap_future(added)
            except Exception:
                rejected = added.done() and not added.cancelled()
                raise
            while True:
                out = await stream.queue.get()  # the engine sends deltas
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                if kind != RequestOutputKind.DELTA and isinstance(out, RequestOutput):
                    out = total = accumulate(total, out)
                if finished or kind != RequestOutputKind.FINAL_ONLY:
                    yield out
                if finished:
                    return
        finally:
            self._drop_stream(request_id, stream)
            if not finished and not rejected:
                self._submit(_Abort([request_id], notify=False), quiet=True)

    def _drop_stream(self, request_id: str, stream: _Stream) -> None:
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]
            self._num_samples -= stream.samples

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests; their streams end with a final output whose finish_reason is
        "abort". Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._submit(_Abort(ids, notify=True))

    def call_in_engine(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the engine thread between two steps (await it with
        `asyncio.wrap_future`, or `.result()` from a plain thread)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            self._submit(_Call(fn, future))
        except EngineDeadError as exc:
            future.set_exception(exc)
        return future

    def _submit(self, cmd: object, quiet: bool = False) -> None:
        with self._lock:
            if not self._closed:
                self._inbox.put(cmd)
                return
        if not quiet:
            raise EngineDeadError(f"the engine loop has stopped: {self._error!r}")

    @property
    def num_queued(self) -> int:
        return max(0, self._num_samples - self._engine_stats.num_running)

    @property
    def is_running(self) -> bool:
        return self._error is None and self._thread.is_alive()

    @property
    def errored(self) -> bool:
        """The engine loop has stopped (shut down, or a step lost the device state)."""
        return not self.is_running

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(f"the engine loop has stopped: {self._error!r}")

    async def get_tokenizer(self, lora_request: object | None = None) -> Tokenizer:
        refuse_lora(lora_request)
        return self.engine.get_tokenizer()

    async def get_model_config(self) -> ModelConfig:
        return self.engine.get_model_config()

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing reset) while a request holds blocks."""
        return await asyncio.wrap_future(self.call_in_engine(LLMEngine.reset_prefix_cache))

    async def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (`LLM.sleep`), with no request unfinished."""
        await asyncio.wrap_future(self.call_in_engine(lambda engine: engine.sleep(level)))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await asyncio.wrap_future(self.call_in_engine(lambda engine: engine.wake_up(tags)))

    async def collective_rpc(self, method: str | Callable[..., Any],
                             timeout: float | None = None, args: tuple[Any, ...] = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """`LLM.collective_rpc`, on the engine thread between two steps."""
        return await asyncio.wrap_future(self.call_in_engine(
            lambda engine: engine.collective_rpc(method, timeout, args, kwargs)))

    async def is_sleeping(self) -> bool:
        return await asyncio.wrap_future(self.call_in_engine(LLMEngine.is_sleeping))

    def stats(self) -> AsyncLLMStats:
        return AsyncLLMStats(self._engine_stats, len(self._streams), self.num_queued,
                             self._num_steps, self._num_join_steps, self._num_joined,
                             self._num_prompt_tokens, self._num_generation_tokens,
                             self._step_seconds)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine loop; unfinished streams raise EngineDeadError."""
        self._submit(_SHUTDOWN, quiet=True)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
            self._error = EngineDeadError("the engine was shut down")
        except BaseException as exc:  # noqa: BLE001 (every stream must hear about it)
            self._error = exc
        self._fail_everything()

    def _drain(self, block: bool) -> bool:
        """Handle every queued command; False on shutdown."""
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for cmd in commands:
            if cmd is _SHUTDOWN:
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                self._abort(cmd)
            elif cmd.future.set_running_or_notify_cancel():
                try:
                    cmd.future.set_result(cmd.fn(self.engine))
                except Exception as exc:  # noqa: BLE001 (handed to the caller)
                    cmd.future.set_exception(exc)
        if commands:
            self._engine_stats = self.engine.stats()
        return True

    def _add(self, cmd: _Add) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return  # the caller went away before the engine saw the request
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.arrival_time,
                                    cmd.priority, cmd.cache_salt)
        except Exception as exc:  # noqa: BLE001 (ValueError mostly: the caller raises it)
            cmd.future.set_exception(exc)
        else:
            cmd.future.set_result(None)

    def _abort(self, cmd: _Abort) -> None:
        final = []
        if cmd.notify:
            states = self.engine.output_processor.states
            final = [_aborted_output(states[r]) for r in cmd.request_ids if r in states]
        self.engine.abort_request(cmd.request_ids)
        self._started.difference_update(cmd.request_ids)
        self._deliver(final)

    def _step(self) -> None:
        start = time.perf_counter()
        outputs = self.engine.step(RequestOutputKind.DELTA)
        self._step_seconds += time.perf_counter() - start
        self._num_steps += 1
        first = continuing = 0
        deliveries: list[RequestOutput | tuple[str, BaseException]] = []
        for out in outputs:
            if out.error is not None:
                self._started.discard(out.request_id)
                deliveries.append((out.request_id, EngineStepError(out.error)))
                continue
            deliveries.append(out)
            if isinstance(out, PoolingRequestOutput):  # a pooling request's one output
                self._num_prompt_tokens += len(out.prompt_token_ids)
                continue
            num_new = sum(len(c.token_ids) for c in out.outputs)
            if num_new:
                if out.request_id in self._started:
                    continuing += 1
                else:
                    self._started.add(out.request_id)
                    self._num_prompt_tokens += len(out.prompt_token_ids)
                    first += 1
                self._num_generation_tokens += num_new
            if out.finished:
                self._started.discard(out.request_id)
            else:
                # The engine keeps updating this object; the consumer reads it later.
                m = out.metrics
                out.metrics = RequestMetrics(m.arrival_time, m.first_token_time,
                                             m.last_token_time)
        if first and continuing:
            self._num_join_steps += 1
            self._num_joined += first
        self._engine_stats = self.engine.stats()
        self._deliver(deliveries)
        if not outputs and self._engine_stats.num_running == 0:
            time.sleep(_IDLE_WAIT_S)

    def _deliver(self, items: list[RequestOutput | tuple[str, BaseException]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for item in items:
            request_id, payload = item if isinstance(item, tuple) else (item.request_id, item)
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, payload))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:
                pass  # that loop is closed: nobody is listening any more

    def _fail_everything(self) -> None:
        with self._lock:
            self._closed = True
        error = EngineDeadError(f"the engine loop has stopped: {self._error!r}")
        error.__cause__ = self._error
        self._deliver([(r, error) for r in list(self._streams)])
        while True:  # what was queued before the door closed gets an answer too
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (_Add, _Call)) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(error)


AsyncLLMEngine = AsyncLLM  # vLLM's name: its V1 AsyncLLMEngine is AsyncLLM too


def _check_queue_bound(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_queued_requests must be a positive integer, got {value!r}")


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, payload in batch:
        q.put_nowait(payload)


def _aborted_output(state: Any) -> RequestOutput | PoolingRequestOutput:
    """The final output of an aborted request (state: output_processor.RequestState)."""
    if state.pooling is not None:  # nothing pooled
        return PoolingRequestOutput(state.request_id, PoolingOutput(None),
                                    state.prompt_token_ids, True, state.prompt,
                                    state.num_cached_tokens)
    comps = [CompletionOutput(s.completion.index, "", [], s.completion.cumulative_logprob,
                              None if s.completion.logprobs is None else [],
                              s.completion.finish_reason or "abort", s.completion.stop_reason)
             for s in state.samples if not s.sent_finish]  # a finish is sent once
    return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, comps, True,
                         state.metrics, state.num_cached_tokens)
