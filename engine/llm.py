"""The offline API in the ecosystem's shape: `LLM(model_dir, **engine_args).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from pathlib import Path

from tqdm import tqdm

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.model_source import resolve_model
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.stop_checker import hides_stop_token
from engine.tokenizer import load_tokenizer


class LLM:
    """A colocated engine in this process. `model`: a checkpoint folder, or a Hub id (`ORG/NAME`, at
    `revision`) in the local Hugging Face cache (engine/model_source.py); None serves the generated
    demo checkpoint. `engine_args` are EngineConfig's fields, e.g. `speculative_config={"method":
    "ngram", "num_speculative_tokens": 4}` or `{"model": DRAFT_DIR, "num_speculative_tokens": 4}`."""

    def __init__(
        self, model: str | Path | None = None, *, revision: str | None = None, progress: bool = True, **engine_args
    ):
        if model is None:
            from engine.demo_model import ensure_demo_model

            model = ensure_demo_model()
        model = resolve_model(str(model), revision)
        self.config = EngineConfig(model_dir=str(model), **engine_args)
        self.engine = LLMEngine(self.config, progress=progress)
        self._tokenizer = None
        self._request_ids = itertools.count()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config.model_dir)
        return self._tokenizer

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        priorities: Seq[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in order, each holding `params.n` completions. Prompts: a string, a
        token-id list, or a list of either. A bad prompt or parameter raises InvalidRequestError before
        any of these requests runs."""
        items = [self._encode(prompt, index) for index, prompt in enumerate(_as_prompt_list(prompts))]
        params = _broadcast(sampling_params or SamplingParams(), len(items), "sampling_params")
        prios = _broadcast(0 if priorities is None else list(priorities), len(items), "priorities")
        # Every completion is a sequence of its own: (prompt index, choice index) per sequence.
        owners = [(i, choice) for i, p in enumerate(params) for choice in range(p.n)]
        ids = self._add_all(
            [items[i] for i, _ in owners], [params[i].for_choice(c) for i, c in owners], [prios[i] for i, _ in owners]
        )
        finished = self._run(ids, use_tqdm)
        seqs: list[list[Sequence]] = [[] for _ in items]
        for request_id, (i, _) in zip(ids, owners, strict=True):
            seqs[i].append(finished[request_id])
        return [self._output(item, p, s) for item, p, s in zip(items, params, seqs, strict=True)]

    def chat(self, conversations, sampling_params=None, **kwargs) -> list[RequestOutput]:
        """Applies the checkpoint's chat template to one conversation or a list of them."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [
            self.tokenizer.apply_chat_template(c, tokenize=True, add_generation_prompt=True) for c in conversations
        ]
        prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
        return self.generate(prompts, sampling_params, **kwargs)

    def _encode(self, prompt, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", f"prompt {index} is empty")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def _add_all(self, items, params, prios) -> list[str]:
        ids: list[str] = []
        try:
            for (_, tokens), sampling, priority in zip(items, params, prios, strict=True):
                request_id = f"offline-{next(self._request_ids)}"
                self.engine.add_request(request_id, tokens, sampling, priority=priority)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # all or nothing: undo the ones already queued
                self.engine.abort_request(request_id)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, Sequence]:
        finished: dict[str, Sequence] = {}
        pending = set(ids)
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                for update in self.engine.step():
                    if update.finish_reason is not None and update.seq_id in pending:
                        finished[update.seq_id] = self.engine.pop_finished(update.seq_id)
                        pending.discard(update.seq_id)
                        bar.update()
        return finished

    def _output(
        self, item: tuple[str | None, list[int]], params: SamplingParams, seqs: list[Sequence]
    ) -> RequestOutput:
        completions = []
        for index, seq in enumerate(seqs):
            assert seq.finish_reason is not None, "_run returns finished sequences only"
            text = seq.stop_text
            if text is None:  # no stop string: the whole output, less the stop token that ended it
                hide_last = hides_stop_token(seq.finish_reason.value, None, params.include_stop_str_in_output)
                shown = seq.output_token_ids[:-1] if hide_last else seq.output_token_ids
                text = self._decode(shown, params.skip_special_tokens)
            metrics = RequestMetrics(
                seq.arrival_time_s,
                seq.first_token_time_s,
                tuple(seq.token_times_s),
                seq.num_spec_steps,
                seq.num_draft_tokens,
                seq.num_accepted_tokens,
            )
            completions.append(
                CompletionOutput(
                    index,
                    text,
                    tuple(seq.output_token_ids),
                    seq.finish_reason.value,
                    metrics,
                    tuple(seq.logprobs) if params.logprobs is not None else None,
                )
            )
        first = seqs[0]
        prompt_logprobs = tuple(first.prompt_logprobs) if params.prompt_logprobs is not None else None
        return RequestOutput(
            first.seq_id,
            item[0],
            tuple(first.prompt_token_ids),
            tuple(completions),
            first.num_cached_tokens,
            prompt_logprobs,
        )

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        try:
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        except Exception:  # noqa: BLE001 - a checkpoint without a tokenizer still serves token ids
            return ""


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _broadcast(value, count: int, field_name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise InvalidRequestError(field_name, f"has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
