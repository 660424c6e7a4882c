"""vLLM `vllm serve` flags kvflow does not implement, each with the reason it is refused.

`kvflow.commands.flag_compat` refuses one of these with exactly one line, "`--X` is not supported by kvflow
(reason)", and exit code 2, before anything starts; only when the command's own parser does not define the flag
(so a flag a later change implements wins automatically, and its row here is then dead and can go).
Single-dash aliases (-pp, -q, ...) are rows of their own. `--no-X` is refused with `--X`'s reason.
"""

from __future__ import annotations

_MULTIMODAL = "kvflow serves text-only models: there is no multimodal input to limit or process"
_LORA = "LoRA adapters are not implemented"
_PROMPT_ADAPTER = "prompt adapters are not implemented"
_FRONTEND = "the router has no such option"
_TLS = "the HTTP front serves plain HTTP; terminate TLS in front of it (cluster RPCs have --tls-cert/--tls-key)"
_CORS = "the router sets no CORS headers; put a proxy in front for browser clients"
_HUB = "models load from local files or built-in presets only (no hub downloads)"
_V0 = "a vLLM V0 engine option with no counterpart in kvflow's scheduler"
_RAY = "kvflow runs its workers as local processes, not on Ray"
_TRACING = "OpenTelemetry tracing is not implemented (metrics are on /metrics)"
_STRUCTURED = ("grammars are compiled by the engines: LLM, generate, prefill, decode, serve and bench "
               "throughput/routing/pd take it; the router only checks a request's constraint")
_SERVER_PROCS = "one router process serves the HTTP API; scale out with more routers behind a load balancer"

UNSUPPORTED: dict[str, str] = {
    # ---- the HTTP front --------------------------------------------------------------------------------------
    "--uvicorn-log-level": "the log level is --log-level, before the sub-command",
    "--disable-uvicorn-access-log": "the router logs no access lines to disable",
    "--allow-credentials": _CORS,
    "--allowed-origins": _CORS,
    "--allowed-methods": _CORS,
    "--allowed-headers": _CORS,
    "--lora-modules": _LORA,
    "--prompt-adapters": _PROMPT_ADAPTER,
    "--chat-template": "the chat template is the model tokenizer's; a request may send its own with "
                       "--trust-request-chat-template",
    "--chat-template-content-format": "message content is always text (strings or text parts)",
    "--response-role": "replies always have the role 'assistant'",
    "--ssl-keyfile": _TLS,
    "--ssl-certfile": _TLS,
    "--ssl-ca-certs": _TLS,
    "--enable-ssl-refresh": _TLS,
    "--ssl-cert-reqs": _TLS,
    "--root-path": "the router serves at the root path; strip a prefix in the proxy in front of it",
    "--middleware": "custom ASGI middleware cannot be loaded into the router",
    "--return-tokens-as-token-ids": _FRONTEND,
    "--disable-frontend-multiprocessing": "the router is its own process already",
    "--enable-request-id-headers": "the router always returns x-request-id",
    "--tool-parser-plugin": "tool-call parser plugins are not implemented",
    "--disable-fastapi-docs": "the router serves no FastAPI docs pages to disable",
    "--enable-prompt-tokens-details": "usage always carries prompt_tokens_details.cached_tokens when tokens were "
                                      "cached",
    "--enable-server-load-tracking": "load is always tracked: see the kvflow:* gauges on /metrics",
    "--max-log-len": "request logs carry token counts, never prompt text, so there is nothing to truncate",
    "--enable-log-requests": "requests are logged by default; --disable-log-requests turns it off",
    "--api-server-count": _SERVER_PROCS,
    "--headless": "a worker without the router is `kvflow prefill` / `kvflow decode`",
    "--config": "YAML config files are not read; pass the flags",
    "--show-hidden-metrics-for-version": "there are no hidden (deprecated) metrics",
    "--otlp-traces-endpoint": _TRACING,
    "--collect-detailed-traces": _TRACING,
    # ---- the model and its files -----------------------------------------------------------------------------
    "--task": "kvflow only generates text (no embedding, classification or scoring models)",
    "--hf-config-path": "the config is read from the model's own folder",
    "--skip-tokenizer-init": "the router and workers need the tokenizer for text prompts and stop strings",
    "--revision": _HUB,
    "--code-revision": _HUB,
    "--tokenizer-revision": _HUB,
    "--hf-token": _HUB,
    "--download-dir": _HUB,
    "--ignore-patterns": _HUB,
    "--tokenizer-mode": "the Hugging Face fast tokenizer is always used",
    "--trust-remote-code": "kvflow implements its architectures itself and never runs model repository code",
    "--allowed-local-media-path": _MULTIMODAL,
    "--config-format": "only Hugging Face config.json (or GGUF metadata) is read",
    "--logits-processor-pattern": "custom logits processors cannot be loaded",
    "--model-impl": "kvflow's own model implementations are the only ones",
    "--model-loader-extra-config": "the loader takes no extra configuration",
    "--qlora-adapter-name-or-path": _LORA,
    "--rope-scaling": "RoPE scaling comes from the model's config.json only",
    "--rope-theta": "RoPE theta comes from the model's config.json only",
    "--hf-overrides": "config.json cannot be overridden from the command line",
    "--override-neuron-config": "there is no Neuron backend",
    "--override-pooler-config": "there are no pooling models",
    "--use-tqdm-on-load": "weight loading shows no per-file progress bar to toggle",
    "--disable-sliding-window": "sliding-window attention is not implemented, so there is nothing to disable",
    # ---- multimodal ------------------------------------------------------------------------------------------
    "--limit-mm-per-prompt": _MULTIMODAL,
    "--mm-processor-kwargs": _MULTIMODAL,
    "--disable-mm-preprocessor-cache": _MULTIMODAL,
    # ---- LoRA / prompt adapters ------------------------------------------------------------------------------
    "--enable-lora": _LORA,
    "--enable-lora-bias": _LORA,
    "--max-loras": _LORA,
    "--max-lora-rank": _LORA,
    "--lora-extra-vocab-size": _LORA,
    "--lora-dtype": _LORA,
    "--long-lora-scaling-factors": _LORA,
    "--max-cpu-loras": _LORA,
    "--fully-sharded-loras": _LORA,
    "--enable-prompt-adapter": _PROMPT_ADAPTER,
    "--max-prompt-adapters": _PROMPT_ADAPTER,
    "--max-prompt-adapter-token": _PROMPT_ADAPTER,
    # ---- engine and scheduler --------------------------------------------------------------------------------
    "--distributed-executor-backend": _RAY,
    "--max-parallel-loading-workers": "each worker loads its own weights; there is no parallel loading to cap",
    "--ray-workers-use-nsight": _RAY,
    "--prefix-caching-hash-algo": "the block hash is fixed (blake2b over a canonical encoding): the router and "
                                  "every worker must agree on it",
    "--use-v2-block-manager": _V0,
    "--num-lookahead-slots": _V0,
    "--max-num-partial-prefills": "chunked prefill schedules one partial prefill at a time",
    "--max-long-partial-prefills": "chunked prefill schedules one partial prefill at a time",
    "--long-prefill-token-threshold": "chunked prefill schedules one partial prefill at a time",
    "--tokenizer-pool-type": "the router's tokenizer pool is a thread pool (--tokenizer-pool-size)",
    "--tokenizer-pool-extra-config": "the router's tokenizer pool is a thread pool (--tokenizer-pool-size)",
    "--num-scheduler-steps": _V0,
    "--multi-step-stream-outputs": _V0,
    "--scheduler-delay-factor": _V0,
    "--disable-async-output-proc": _V0,
    "--scheduling-policy": "requests are scheduled first come, first served (no priorities)",
    "--scheduler-cls": "the scheduler cannot be replaced",
    "--worker-cls": "the worker cannot be replaced",
    "--worker-extension-cls": "the worker cannot be extended",
    "--compilation-config": "there is no torch.compile configuration (CUDA graphs: --cudagraph-capture-sizes)",
    "-O": "there is no torch.compile configuration (CUDA graphs: --cudagraph-capture-sizes)",
    "--cuda-graph-sizes": "the capture sizes are --cudagraph-capture-sizes",
    "--kv-transfer-config": "prefill/decode KV transfer is built in: --prefill-workers, --kv-transfer-backend",
    "--kv-events-config": "KV events always go to the router's prefix index (--index)",
    "--enable-sleep-mode": "workers cannot sleep and wake; stop and start them",
    "--calculate-kv-scales": ("fp8 KV scales come from the checkpoint's k_scale/v_scale, else 1.0; scales taken from "
                              "the first batch would differ between prefill and decode workers"),
    "--additional-config": "there are no platform plugins to configure",
    "--enable-reasoning": "reasoning-content parsing is not implemented",
    "--reasoning-parser": "reasoning-content parsing is not implemented",
    "--disable-cascade-attn": "cascade attention is not implemented, so there is nothing to disable",
    "--async-scheduling": "the engine loop schedules synchronously",
    "--data-parallel-address": "data parallelism is `kvflow serve --decode-workers N` (one engine per worker)",
    "--data-parallel-rpc-port": "data parallelism is `kvflow serve --decode-workers N` (one engine per worker)",
    "--data-parallel-size-local": "data parallelism is `kvflow serve --decode-workers N` (one engine per worker)",
    "--data-parallel-backend": "data parallelism is `kvflow serve --decode-workers N` (one engine per worker)",
}

# ---- flags other branches are implementing now ------------------------------------------------------------------
# The lead deletes each row when the feature that defines the flag is merged (the parser's own flag wins anyway).
IN_PROGRESS: dict[str, str] = {
    # Implemented on some commands only: elsewhere (where the parser lacks them) they are refused with the reason.
    "--data-parallel-size": "data-parallel replicas are `kvflow serve --data-parallel-size N` (behind its router)",
    "-dp": "data-parallel replicas are `kvflow serve --data-parallel-size N` (behind its router)",
    "--speculative-config": "speculative decoding runs where tokens are decoded: LLM, generate, bench, decode, serve",
    "--speculative-model": "speculative decoding runs where tokens are decoded: LLM, generate, bench, decode, serve",
    "--num-speculative-tokens": "speculative decoding runs where tokens are decoded: LLM, generate, bench, decode, "
                                "serve",
    "--ngram-prompt-lookup-max": "speculative decoding runs where tokens are decoded: LLM, generate, bench, decode, "
                                 "serve",
    "--ngram-prompt-lookup-min": "speculative decoding runs where tokens are decoded: LLM, generate, bench, decode, "
                                 "serve",
    "--tool-call-parser": "tool calls are parsed by the router: `kvflow router` / `kvflow serve`",
    "--enable-auto-tool-choice": "tool calls are parsed by the router: `kvflow router` / `kvflow serve`",
    "--guided-decoding-backend": _STRUCTURED,
    "--structured-outputs-config": _STRUCTURED,
}


def reason_for(flag: str) -> str | None:
    """Why `flag` (a long or short option string, `--no-X` included) is refused; None: not in the tables."""
    for name in (flag, "--" + flag[5:] if flag.startswith("--no-") else None):
        if name is not None:
            reason = UNSUPPORTED.get(name) or IN_PROGRESS.get(name)
            if reason is not None:
                return reason
    return None


def refusal_line(flag: str, reason: str) -> str:
    return f"`{flag}` is not supported by kvflow ({reason})"
