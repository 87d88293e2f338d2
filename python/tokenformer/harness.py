"""An lm-evaluation-harness model adapter: any harness task runs on the
tokenformer engine.

    import lm_eval, tokenformer.harness
    lm_eval.simple_evaluate(model="tokenformer",
                            model_args="pretrained=tokenformer-150m,weights=f16",
                            tasks=["lambada_openai", "piqa"])

or pass ``tokenformer.harness.TokenFormerLM(pretrained=...)`` as ``model``.
Importing this module registers the name ``tokenformer`` when the harness is
installed; without it the class still works on any objects with an ``args``
tuple (the harness's ``Instance``).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from . import LanguageModel
from ._tokenformer import DEFAULT_BATCH_SIZE

try:  # The harness is optional: subclass and register when it is there.
    # The harness fills its model registry with its own models (lazily) only
    # while the registry is empty: without this import, registering ours first
    # would hide "hf", "local-completions" and the rest from `get_model`.
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import LM as _Base
    from lm_eval.api.registry import register_model as _register
except ImportError:  # pragma: no cover - exercised when lm_eval is absent
    _Base = object

    def _register(*_names):
        return lambda cls: cls


# The harness's default for generate_until when a task gives no max_gen_toks.
DEFAULT_MAX_GEN_TOKS = 256


@_register("tokenformer")
class TokenFormerLM(_Base):
    """The harness's three request types on a tokenformer ``LanguageModel``.

    ``pretrained``: a zoo name, Hub repo id or local path; ``tokenizer``,
    ``config``: overrides; ``weights``: "f32", "f16" or "q8"; ``device``:
    "cpu" (also when the harness passes none), "cuda", "cuda:N" or "auto";
    ``dtype``: "f32", "bf16" or "f16" (torch's spellings "float32",
    "bfloat16", "float16" too; "auto" is f32). ``batch_size``: how many
    sequences ``generate_until`` decodes together (default 8; "auto": 8).
    Harness options it has no use for are accepted and ignored.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        tokenizer: str | None = None,
        config: str | None = None,
        weights: str = "f32",
        model: LanguageModel | None = None,
        device: str | None = None,
        dtype: str = "f32",
        **_ignored: Any,
    ) -> None:
        if _Base is not object:
            super().__init__()
        if model is None:
            if pretrained is None:
                raise ValueError("TokenFormerLM needs pretrained=NAME (or model=LanguageModel)")
            model = LanguageModel.from_pretrained(
                pretrained,
                tokenizer=tokenizer,
                config=config,
                weights=weights,
                device=device or "cpu",
                dtype="f32" if dtype == "auto" else dtype,
            )
        self.model = model
        # Sequences generate_until decodes together ("auto" and the like: the library's default).
        size = str(_ignored.get("batch_size"))
        self.batch_size = int(size) if size.isdigit() and int(size) > 0 else DEFAULT_BATCH_SIZE

    @property
    def eot_token_id(self) -> int:
        return self.model.eot_token_id

    @property
    def max_length(self) -> int:
        return self.model.max_length

    @property
    def tokenizer_name(self) -> str:
        return self.model.source

    def loglikelihood(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [tuple(r.args[:2]) for r in requests]
        out = self.model.loglikelihood(pairs)
        for r, res in zip(requests, out):
            self._cache("loglikelihood", r, res)
        return out

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
        out = self.model.loglikelihood_rolling([r.args[0] for r in requests])
        for r, res in zip(requests, out):
            self._cache("loglikelihood_rolling", r, res)
        return out

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        # Requests with the same generation settings are decoded together.
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            key = json.dumps(self._kwargs(r), sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
        out: list[str] = [""] * len(requests)
        for idx in groups.values():
            texts = self._generate([requests[i].args[0] for i in idx], self._kwargs(requests[idx[0]]))
            for i, text in zip(idx, texts):
                self._cache("generate_until", requests[i], text)
                out[i] = text
        return out

    @staticmethod
    def _kwargs(request: Any) -> dict:
        return dict(request.args[1] if len(request.args) > 1 else {})

    def _generate(self, contexts: list[str], kwargs: dict) -> list[str]:
        until = kwargs.pop("until", None)
        if isinstance(until, str):
            until = [until]
        if not until:
            until = [self.model.decode([self.eot_token_id])]
        max_gen = int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0))
        if not do_sample:
            temperature = 0.0
        sampling = {}
        for key in ("top_k", "top_p", "seed"):
            if kwargs.get(key) is not None:
                sampling[key] = kwargs[key]
        if kwargs.get("repetition_penalty") is not None:
            sampling["repeat_penalty"] = float(kwargs["repetition_penalty"])
            sampling["repeat_last_n"] = 0  # transformers looks at the whole sequence
        # As the harness: keep the last (max_length - max_gen_toks) context tokens.
        room = max(1, self.max_length - max_gen)
        prompts = [self.model.encode(c)[-room:] for c in contexts]
        return self.model.generate(
            prompts, max_gen, temperature=temperature, stop=list(until),
            batch_size=self.batch_size, **sampling
        )

    def _cache(self, kind: str, request: Any, result: Any) -> None:
        hook = getattr(self, "cache_hook", None)
        if hook is not None:
            hook.add_partial(kind, request.args, result)
