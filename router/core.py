"""The router's request path, shared by the OpenAI and gRPC fronts: tokenize, route, forward, retry, measure.

Routing hashes the prompt's full blocks with the engine's own `BlockHasher`, asks the index (one lookup) how
many leading blocks each prefill worker caches, and lets the policy weigh that against load. The request goes to
the chosen decode worker's `Generate` with `disaggregation.prefill_address` naming the prefill worker; the decode
worker falls back to local prefill by itself if that prefill fails. When another worker serving `Prefill` caches
more of the prompt than the planned prefiller, it may be named the prefill worker instead (a fetch: it computes
only its uncached tail and ships its cached blocks; cluster/routing/disagg.py `choose_fetch`). A decode failure before the first token is
retried on another decode worker; one after it migrates the request to another decode worker (the prompt plus
the tokens already streamed), up to `--max-migrations` times.

Request ids are the caller's and belong to the caller: a request is known under (owner, id), the owner being the
caller's identity (router/ownership.py: the API key presented, hashed, or the connection; on gRPC with an owner
token), so `abort` reaches only the owner's own requests. Workers see ids of the router's own making (`<id>@<random>`, cluster.request_ids).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc

from cluster.request_ids import attempt_request_id
from cluster.routing.disagg import PrefillPath, choose_fetch, choose_prefill_path, fetch_transfer_cost
from cluster.routing.events import EventBatch
from cluster.routing.index import IndexUnavailable, MemoryIndex, PrefixIndex, TierMatch
from cluster.routing.planner import PaceSampler
from cluster.routing.policy import make_policy, reload_cost
from cluster.wire import FINISH_REASON_FROM_PROTO, MAX_MESSAGE_BYTES
from engine.core.block_hash import BlockHasher
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from router.config import RouterConfig
from router.delivered import Delivered, WorkerFailed
from router.drain_forecast import DrainForecast, GenerationTracker
from router.errors import BadRequest, RouterError, Unavailable, from_code_name
from router.lifecycle import Lifecycle
from router.metrics import RouterMetrics, worker_namer
from router.pools import PoolManager
from router.route import Route, uncached_tokens
from router.tokenizer_pool import TokenizerPool, tokenizer_path_for
from router.workers import ModelInfo, Worker, WorkerPool

logger = logging.getLogger(__name__)

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.INTERNAL)
WORKER_FAILURES = ("UNAVAILABLE", "INTERNAL")  # GenerateError codes after which another worker may take over


def make_index(url: str) -> PrefixIndex:
    if url == "memory":
        return MemoryIndex()
    from cluster.routing.redis_index import RedisIndex

    return RedisIndex(url)


class Router:
    def __init__(self, config: RouterConfig) -> None:
        config.validate()
        self.config = config
        token = config.cluster.token
        self.worker_name = worker_namer(config.expose_worker_addresses, token.encode() if token else b"")
        self.metrics = RouterMetrics(self.worker_name)
        self.lifecycle = Lifecycle()
        self.index = make_index(config.index)
        self.policy = make_policy(config.routing)
        self.pool = WorkerPool(self.index, subscriber=f"router-{uuid.uuid4().hex[:8]}", on_batch=self._on_batch,
                               on_index_error=self._on_index_error, auth=config.cluster)
        self.pools = PoolManager(self.pool, self.metrics, config.planner_config(),
                                 adaptive=config.disagg_policy == "adaptive")
        self.tokenizers: TokenizerPool | None = None
        # the first tokenizer load has finished, loaded or failed: /health waits for it, since every request
        # does (`generate`), and a load takes seconds (7 s for Llama-3.1-8B's on a GPU host)
        self.tokenizers_settled = False
        self._tokenizer_lock = asyncio.Lock()
        self._channels: dict[str, grpc.aio.Channel] = {}
        # (owner, client id) -> {worker request id: decode worker} of the requests in flight, for Abort
        self._decode_of: dict[tuple[str, str], dict[str, Worker]] = {}
        self._index_down = False
        self.generations = GenerationTracker()  # for the drain's forecast of what it will cut

    # ---- state ---------------------------------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        info = self.pool.model_info
        if info is None:
            raise Unavailable("no worker has answered yet; retry shortly")
        return info

    @property
    def served_model_names(self) -> list[str]:
        if self.config.served_model_name:
            return list(self.config.served_model_name)
        return [self.pool.model_info.model] if self.pool.model_info else []

    def is_ready(self) -> bool:
        return self.pool.model_info is not None and bool(self.pool.workers("decode"))

    async def ensure_tokenizers(self) -> TokenizerPool:
        if self.tokenizers is None:
            async with self._tokenizer_lock:
                if self.tokenizers is None:
                    try:
                        info = self.model_info
                        hasher = BlockHasher.for_model(info.model_id, info.block_size)
                        path = await asyncio.to_thread(tokenizer_path_for, info.model, self.config.tokenizer)
                        self.tokenizers = await asyncio.to_thread(TokenizerPool, path, hasher,
                                                                  self.config.tokenizer_pool_size,
                                                                  self.config.chat_template_workers)
                    finally:
                        self.tokenizers_settled = True
        return self.tokenizers

    # ---- index callbacks (event threads) -------------------------------------------------------------
    def _on_batch(self, worker: Worker, batch: EventBatch, lag_s: float) -> None:
        if batch.events:
            self.metrics.index_lag.observe(max(lag_s, 0.0))
        if batch.load is not None:
            self.metrics.observe_load(worker.worker_id, worker.role, batch.load)
        if self._index_down:
            self._index_down = False
            logger.warning("prefix index is reachable again: prefix-aware routing resumed")

    def _on_index_error(self, exc: IndexUnavailable) -> None:
        self.metrics.index_unavailable.inc()
        if not self._index_down:
            self._index_down = True
            logger.error("%s; routing on load only until it is back", exc)

    # ---- routing -------------------------------------------------------------------------------------
    def route(self, token_ids: Sequence[int], cache_salt: Sequence[str] = (),
              exclude_decode: frozenset[str] = frozenset()) -> Route:
        """Pick the decode worker, and where the prompt is prefilled: on a prefill-pool worker (by cached prefix and
        load) or on the decode worker itself (cluster/routing/disagg.py). Without a prefill pool (replicas) the
        decode worker is picked by cached prefix and load (`RoutingPolicy.choose_replica`); beside one, by load.
        Runs in a tokenizer thread: hashing and the index lookup block."""
        start = time.perf_counter()
        info = self.model_info
        decodes = [w for w in self.pool.workers("decode") if w.address not in exclude_decode]
        if not decodes:
            raise Unavailable("no healthy decode worker is available")
        prefills = self.pool.workers("prefill")
        holders = self._fetch_candidates(exclude_decode)
        tiers = self._matched_blocks(token_ids, cache_salt, prefills, decodes, holders)
        matched = {wid: m.blocks for wid, m in tiers.items()}
        on_host = {wid: m.host_blocks for wid, m in tiers.items()}
        by_id = {w.worker_id: w for w in prefills}
        prefill = None
        prefill_blocks = 0
        if prefills:
            choice = self.policy.choose_prefill([w.view() for w in prefills], matched, len(token_ids),
                                                info.block_size, on_host)
            prefill, prefill_blocks = by_id[choice.worker.worker_id], choice.matched_blocks
            decode_view = self.policy.choose_decode([w.view() for w in decodes])
        else:  # replicas: the decode worker prefills the prompt itself (cluster/routing/policy.py choose_replica)
            decode_view = self.policy.choose_replica([w.view() for w in decodes], matched, len(token_ids),
                                                     info.block_size, on_host).worker
        decode = next(w for w in decodes if w.address == decode_view.address)
        local_blocks = matched.get(decode.worker_id, 0)
        path = choose_prefill_path(self.config.disagg_policy, prefill.view() if prefill is not None else None,
                                   decode_view, uncached_tokens(len(token_ids), prefill_blocks, info.block_size),
                                   uncached_tokens(len(token_ids), local_blocks, info.block_size))
        if not path.remote:
            prefill, prefill_blocks = None, local_blocks
        holder = self._fetch_holder([w for w in holders if w is not decode], decode, prefill, tiers,
                                    len(token_ids), info.block_size)
        if holder is not None:
            prefill, prefill_blocks = holder, matched[holder.worker_id]
            path = PrefillPath(True, "fetch")
        self.metrics.prefill_path.labels("remote" if path.remote else "local", path.reason).inc()
        host_blocks = on_host.get((prefill or decode).worker_id, 0)
        self.metrics.route_decisions.labels(self.policy.name).inc()
        self.metrics.prefix_matched_blocks.inc(prefill_blocks)
        self.metrics.prefix_matched_host_blocks.inc(host_blocks)
        if prefill_blocks:
            self.metrics.route_prefix_hits.inc()
        self.metrics.route_seconds.observe(time.perf_counter() - start)
        return Route(decode, prefill, prefill_blocks, len(token_ids), info.block_size, host_blocks,
                     fetch=holder is not None)

    def _fetch_candidates(self, exclude: frozenset[str]) -> list[Worker]:
        """Workers another may pull a cached prefix from (healthy, serving `Prefill`, not a failed decode
        attempt's); none with --no-prefix-fetch."""
        if not self.config.prefix_fetch:
            return []
        return [w for w in self.pool.all_workers() if w.healthy and w.serves_prefill and w.address not in exclude]

    def _fetch_holder(self, candidates: list[Worker], decode: Worker, planned: Worker | None,
                      tiers: dict[str, TierMatch], num_tokens: int, block_size: int) -> Worker | None:
        """The worker to pull the prompt's cached prefix from, or None to keep the plan (`planned` prefills, or
        the decode worker itself when None): of the candidates, the one caching the most leading blocks, more
        than the planned prefiller, when `choose_fetch` finds that faster (cluster/routing/disagg.py)."""
        planner = planned or decode
        none = TierMatch(0, 0)
        holders = [w for w in candidates if tiers.get(w.worker_id, none).blocks > tiers.get(planner.worker_id,
                                                                                             none).blocks]
        if not holders:
            return None
        holder = max(holders, key=lambda w: (tiers[w.worker_id].blocks, -w.view().queued_prefill_tokens))

        def work(worker: Worker) -> float:
            """Tokens `worker` computes for the prompt, its host-tier loads counted at their measured cost."""
            match, view = tiers.get(worker.worker_id, none), worker.view()
            host_tokens = min(match.host_blocks * block_size, num_tokens)
            return uncached_tokens(num_tokens, match.blocks, block_size) + host_tokens * reload_cost(view,
                                                                                               self.policy.weights)

        decode_view = decode.view()
        choice = choose_fetch(
            holder.view(), planner.view(), planned is not None, work(holder), work(planner),
            uncached_tokens(num_tokens, tiers.get(decode.worker_id, none).blocks, block_size),
            decoding=decode_view.load.num_running > 0 or decode_view.pending_requests > 0,
            transfer_cost=fetch_transfer_cost(decode_view, holder.view()))
        self.metrics.fetch_decisions.labels("fetch" if choice.remote else "recompute", choice.reason).inc()
        return holder if choice.remote else None

    def _matched_blocks(self, token_ids: Sequence[int], cache_salt: Sequence[str], prefills: list[Worker],
                        decodes: list[Worker], holders: list[Worker]) -> dict[str, TierMatch]:
        """Leading prompt blocks each candidate caches, and how many in its host tier: the prefill pool's, the
        decode pool's (adaptive: they may prefill locally; a fetch: what they lack is shipped), and the workers a
        prefix may be fetched from."""
        candidates = [w.worker_id for w in prefills]
        # adaptive: a decode worker may prefill locally; a fetch weighs what it caches; replicas prefill locally
        if self.config.disagg_policy == "adaptive" or holders or not prefills:
            candidates += [w.worker_id for w in decodes]
        candidates = list(dict.fromkeys(candidates + [w.worker_id for w in holders]))
        if not candidates or not self.policy.uses_index or self.tokenizers is None:
            return {}
        hashes = self.tokenizers.hasher.hash_blocks(token_ids, extra_keys=tuple(cache_salt))
        try:
            return self.index.match_tiers(hashes, candidates)
        except IndexUnavailable as exc:
            self._on_index_error(exc)
            return {}

    def check_prompt(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str = "prompt",
                     max_tokens_param: str = "max_tokens") -> int:
        """Validate lengths against max_model_len; returns max_tokens (filled in when None)."""
        limit = self.model_info.max_model_len
        if num_prompt_tokens == 0:
            raise BadRequest("the prompt is empty", prompt_param)
        if num_prompt_tokens >= limit:
            raise BadRequest(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                             f"{num_prompt_tokens} tokens; shorten it.", prompt_param)
        if max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise BadRequest(f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                             f"{max_tokens} for the completion). Reduce the prompt or {max_tokens_param}.",
                             max_tokens_param)
        return max_tokens

    def params_for_prompt(self, params: pb.SamplingParams, num_prompt_tokens: int, prompt_param: str = "prompt",
                          max_tokens_param: str = "max_tokens") -> pb.SamplingParams:
        """A copy of `params` for one prompt, max_tokens checked against max_model_len or filled with the room
        left (per prompt: prompts of one request differ in length)."""
        asked = params.max_tokens if params.HasField("max_tokens") else None
        max_tokens = self.check_prompt(num_prompt_tokens, asked, prompt_param, max_tokens_param)
        if params.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({params.min_tokens}) is more than the {max_tokens} tokens this prompt leaves "
                             "for the completion", "min_tokens")
        out = pb.SamplingParams()
        out.CopyFrom(params)
        out.max_tokens = max_tokens
        return out

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        """Ids must be in the vocabulary: block hashing and the wire take uint32, and a worker refuses the rest."""
        vocab = self.model_info.vocab_size or 2**32
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
            raise BadRequest(f"{param}: token ids must be integers in [0, {vocab}), got values from {min(token_ids)} "
                             f"to {max(token_ids)}", param)

    # ---- forwarding ----------------------------------------------------------------------------------
    def _stub(self, address: str) -> kvflow_pb2_grpc.GenerationStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self.config.cluster.aio_channel(
                address, [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
            self._channels[address] = channel
        return kvflow_pb2_grpc.GenerationStub(channel)

    async def generate(self, request_id: str, token_ids: list[int], params: pb.SamplingParams,
                       cache_salt: Sequence[str] = (), owner: str = "") -> AsyncIterator[pb.GenerateResponse]:
        """Stream a request's responses from a decode worker; `owner` (router/ownership.py) is who may `abort` it.

        A decode failure before the first token is retried on another decode worker. One after it (the worker
        died, failed or drained mid-stream) migrates the request: another decode worker gets the prompt plus the
        tokens already streamed (`resume_token_ids`), continues the same sampling (a seeded generator included)
        and streams only new tokens, so the caller's stream simply continues. Single-sample requests, at most
        `max_migrations` times; past that, or with no other decode worker, the error reaches the caller.
        Raises RouterError for failures; metrics are recorded here.
        """
        key = (owner, request_id)
        tokenizers = await self.ensure_tokenizers()
        arrival = time.monotonic()
        tried: set[str] = set()
        delivered = Delivered()
        migrations = 0
        attempts = 0
        single_sample = (params.n or 1) == 1
        budget = params.max_tokens if params.HasField("max_tokens") else self.model_info.max_model_len - len(token_ids)
        generation = self.generations.start(budget, params.n or 1)
        self.metrics.running.inc()
        first_token_at: float | None = None
        last_chunk_at = arrival
        pace = PaceSampler()
        try:
            while True:
                attempts += 1
                self.metrics.waiting.inc()
                try:
                    route = await tokenizers.run(self.route, token_ids, tuple(cache_salt), frozenset(tried))
                finally:
                    self.metrics.waiting.dec()
                tried.add(route.decode.address)
                self.pools.planner.observe_route(time.monotonic(), route.prefill is not None, route.uncached_tokens)
                worker_request_id = attempt_request_id(request_id)  # client ids may repeat; ours don't
                request = pb.GenerateRequest(
                    request_id=worker_request_id, token_ids=pb.TokenIds(ids=token_ids), sampling_params=params,
                    stream=True, cache_salt=list(cache_salt), resume_token_ids=delivered.token_ids,
                    disaggregation=self._disaggregation(route, resumed=bool(delivered.token_ids)))
                self._reserve(route, +1)
                self._decode_of.setdefault(key, {})[worker_request_id] = route.decode
                call = self._stub(route.decode.address).Generate(request, timeout=self.config.request_timeout_s)
                released = False
                delivered.start_attempt()
                try:
                    async for response in call:
                        kind = response.WhichOneof("response")
                        if kind == "error":
                            if response.error.code in WORKER_FAILURES:
                                raise WorkerFailed("decode_error", response.error.message)
                            raise from_code_name(response.error.code, response.error.message)
                        now = time.monotonic()
                        if first_token_at is None:
                            first_token_at = now
                            self.metrics.ttft.observe(now - arrival)
                            self.pools.planner.observe_ttft(now, now - arrival)
                        elif kind == "chunk" and response.chunk.token_ids:
                            self._observe_gap(now - last_chunk_at, len(response.chunk.token_ids))
                            self._observe_pace(now, pace.add(now - last_chunk_at, len(response.chunk.token_ids)))
                        last_chunk_at = now
                        if not released:
                            self._reserve(route, -1, prefill_only=True)
                            released = True
                        if kind == "chunk":
                            delivered.add(response.chunk)
                            generation.add(len(response.chunk.token_ids), now)
                        elif kind == "complete":
                            delivered.complete(response.complete)
                            self._record_complete(response.complete, arrival, first_token_at)
                            self._check_prediction(route, response.complete, bool(request.resume_token_ids))
                        yield response
                    return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        raise BadRequest(exc.details() or "invalid request") from exc
                    if exc.code() not in RETRYABLE:
                        raise from_code_name(exc.code().name, f"decode worker {route.decode.address}: "
                                                              f"{exc.details()}") from exc
                    failure = WorkerFailed("decode_unavailable", exc.details() or exc.code().name)
                except WorkerFailed as exc:
                    failure = exc
                finally:
                    call.cancel()
                    self._reserve(route, -1, skip_prefill=released)
                    self._forget(key, worker_request_id)
                if first_token_at is None:  # nothing reached the caller: try another decode worker
                    if attempts >= self.config.max_attempts:
                        raise Unavailable(f"no decode worker could take the request ({failure.detail})")
                    self._retry_note(route, failure.reason, failure.detail)
                    continue
                if not single_sample or migrations >= self.config.max_migrations:
                    raise Unavailable(f"decode worker {route.decode.address} failed mid-stream ({failure.detail}); "
                                      f"not migrated after {migrations} migrations")
                migrations += 1
                self.metrics.migrations.labels(failure.reason).inc()
                logger.warning("request %s: decode worker %s failed after %d tokens (%s); migrating", request_id,
                               route.decode.address, len(delivered.token_ids), failure.detail)
        finally:
            self._observe_pace(time.monotonic(), pace.flush(min_seconds=pace.period_s / 2))
            self.metrics.running.dec()
            self.generations.end(generation)

    def drain_forecast(self, timeout_s: float) -> DrainForecast:
        return self.generations.forecast(timeout_s)

    async def abort(self, request_id: str, owner: str = "") -> bool:
        """Abort `owner`'s requests in flight under `request_id` (another caller's are not found)."""
        found = False
        for worker_request_id, worker in list(self._decode_of.get((owner, request_id), {}).items()):
            response = await self._stub(worker.address).Abort(pb.AbortRequest(request_id=worker_request_id),
                                                               timeout=5.0)
            found = found or response.found
        return found

    def _forget(self, key: tuple[str, str], worker_request_id: str) -> None:
        targets = self._decode_of.get(key)
        if targets is not None:
            targets.pop(worker_request_id, None)
            if not targets:
                del self._decode_of[key]

    def _disaggregation(self, route: Route, resumed: bool) -> pb.DisaggregationParams:
        """Where the decode worker gets the prompt's KV: the chosen prefill worker, or (empty) its own prefill. A
        migrated request resumes with a local prefill. Adaptive: the router's choice is final (min 1 token)."""
        if route.prefill is None or resumed:
            return pb.DisaggregationParams(prefill_address="")
        # Adaptive, or a fetch: the router's choice is final; static: the decode worker's threshold.
        final = 1 if self.config.disagg_policy == "adaptive" or route.fetch else 0
        return pb.DisaggregationParams(prefill_address=route.prefill.address, min_prompt_tokens=final)

    def _observe_gap(self, seconds: float, num_tokens: int) -> None:
        """A streamed chunk's gap since the previous one, per token it carries (speculation batches several)."""
        per_token = seconds / num_tokens
        self.metrics.itl.observe(per_token)
        self.generations.observe_itl(per_token)

    def _observe_pace(self, now: float, seconds_per_token: float | None) -> None:
        """A request's pace over its last period (cluster/routing/planner.py `PaceSampler`): the planner's ITL."""
        if seconds_per_token is not None:
            self.pools.planner.observe_itl(now, seconds_per_token)

    def _reserve(self, route: Route, sign: int, prefill_only: bool = False, skip_prefill: bool = False) -> None:
        """Count this router's own in-flight work so back-to-back routes see it before the next heartbeat."""
        if not skip_prefill:
            target = route.prefills_on
            target.pending_prefill_tokens = max(target.pending_prefill_tokens + sign * route.uncached_tokens, 0)
        if not prefill_only:
            route.decode.pending_requests = max(route.decode.pending_requests + sign, 0)

    def _retry_note(self, route: Route, reason: str, detail: str) -> None:
        self.metrics.retries.labels(reason).inc()
        logger.warning("decode worker %s failed before the first token (%s); retrying elsewhere",
                       route.decode.address, detail)

    def _record_complete(self, complete: pb.GenerateComplete, arrival: float, first_token_at: float | None) -> None:
        m = self.metrics
        now = time.monotonic()
        usage = complete.usage
        m.e2e.observe(now - arrival)
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generation_tokens.inc(usage.completion_tokens)
        m.prefix_queries.inc(usage.prompt_tokens)
        m.prefix_hits.inc(usage.cached_tokens)
        per_sample = usage.completion_tokens / max(len(complete.choices), 1)
        if first_token_at is not None and per_sample > 1:
            m.tpot.observe((now - first_token_at) / (per_sample - 1))
        path = {pb.PREFILL_PATH_DISAGGREGATED: "disaggregated", pb.PREFILL_PATH_LOCAL: "local_prefill"}.get(
            complete.prefill_path, "unknown")
        m.requests.labels(path).inc()
        for choice in complete.choices:
            reason = FINISH_REASON_FROM_PROTO.get(choice.finish_reason, "unspecified")
            m.request_success.labels(reason).inc()

    def _check_prediction(self, route: Route, complete: pb.GenerateComplete, resumed: bool) -> None:
        """A false hit: the index promised cached blocks on the worker that prefilled, and it recomputed some of
        them (evicted meanwhile, or advertised but not servable). Not judged: a resumed prompt (not what was
        routed), and a disaggregated route that fell back to a local prefill (another worker's cache)."""
        if resumed or (route.prefill is not None and complete.prefill_path != pb.PREFILL_PATH_DISAGGREGATED):
            return
        cached_tokens = complete.usage.cached_tokens
        if cached_tokens < route.predicted_cached_tokens:
            self.metrics.false_hits.inc()
            logger.debug("false prefix hit on %s: %d tokens predicted cached, %d were", route.prefills_on.address,
                         route.predicted_cached_tokens, cached_tokens)

    async def close(self) -> None:
        self.pool.stop()
        for channel in self._channels.values():
            await channel.close()
        if self.tokenizers is not None:
            self.tokenizers.close()
        self.index.close()


def error_from(exc: BaseException) -> RouterError:
    if isinstance(exc, RouterError):
        return exc
    if isinstance(exc, ValueError):  # engine.errors.InvalidRequest (which names its field) and friends
        return BadRequest(str(exc), getattr(exc, "param", None))
    return RouterError(f"internal error: {type(exc).__name__}: {exc}")


__all__ = ["Route", "Router", "error_from", "make_index"]
