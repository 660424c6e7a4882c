"""The offline API: `LLM(model, **engine_args).generate(prompts, sampling_params)`, as in vLLM."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from engine.arg_utils import EngineArgs
from engine.llm_engine import LLMEngine, PromptInput
from engine.metrics.stat_logger import StatLogger
from engine.metrics.stats import EngineStats
from engine.outputs import RequestOutput
from engine.process.openmp import SHARED_CORES_GOMP_SPINCOUNT, apply_openmp_policy
from engine.processing.tokenizer import apply_chat_template
from engine.sampling_params import SamplingParams
from kvflow.closing import Closing

logger = logging.getLogger(__name__)
Messages = list[dict[str, Any]]


class LLM(Closing):
    def __init__(self, model: str = "smollm2", **engine_args: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        if self.llm_engine.device.type == "cpu" and not apply_openmp_policy():
            logger.warning("torch was imported before kvflow, so libgomp keeps its full spin: beside other busy "
                           "processes CPU generation can run several times slower; set GOMP_SPINCOUNT=%s, or "
                           "import kvflow first (engine/process/openmp.py)", SHARED_CORES_GOMP_SPINCOUNT)
        self._next_id = 0
        # vLLM's LLM logs no stats unless asked: LLM(..., disable_log_stats=False).
        self._stat_logger = None if self.engine_args.disable_log_stats else \
            StatLogger(self.llm_engine.device.type)

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (also done at interpreter exit); idempotent."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the generation config's defaults (--generation-config and its override),
        or plain SamplingParams() when there are none."""
        defaults = self.llm_engine.generation_defaults
        return SamplingParams(**defaults) if defaults else SamplingParams()

    @property
    def stats(self) -> EngineStats:
        return self.llm_engine.stats

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = self._per_prompt(sampling_params, len(prompts))
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(self.llm_engine.add_request(str(self._next_id), prompt, p, output_kind="final"))
                self._next_id += 1
        except Exception:
            self.llm_engine.abort_request(ids)  # all or nothing: no half-submitted batch keeps running
            self.llm_engine.step()
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts: list[PromptInput] = []
        for conversation in conversations:
            text = apply_chat_template(tokenizer, conversation, add_generation_prompt, chat_template)  # type: ignore[arg-type]
            ids = tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        while len(done) < len(ids):
            outputs = self.llm_engine.step()
            if self._stat_logger is not None:
                self._stat_logger.observe(self.llm_engine.stats)
            for output in outputs:
                if output.finished and output.request_id in wanted:
                    done[output.request_id] = output
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
