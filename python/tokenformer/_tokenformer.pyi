"""Types of the native module, `python/src/lib.rs` (checked against it by
`mypy.stubtest` in CI): what editors and type checkers see. Settings are
strings, as the command line's flags: `device` "cpu", "cuda", "cuda:N" or
"auto"; `dtype` "f32", "bf16" or "f16"; `weights` "f32", "f16" or "q8";
`kv_dtype` "f32" or "f16"."""

import os
from typing import (
    List,
    Literal,
    Optional,
    Sequence,
    Tuple,
    TypedDict,
    Union,
    final,
    overload,
    type_check_only,
)

import numpy as np
import numpy.typing as npt

_Path = Union[str, os.PathLike[str]]
_FinishReason = Literal["eos_token", "stop_sequence", "length"]

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "ImageClassifier",
    "ImageTextModel",
    "LanguageModel",
    "Score",
    "TokenFormerError",
]

DEFAULT_BATCH_SIZE: int

class TokenFormerError(Exception):
    """An error of the tokenformer library (bad input, a missing file, a Hub failure)."""

@type_check_only
class _Generation(TypedDict):
    generated_text: str
    finish_reason: _FinishReason
    prompt_tokens: int
    generated_tokens: int

@type_check_only
class _PredictionBase(TypedDict):
    index: int
    prob: float

@type_check_only
class _Prediction(_PredictionBase, total=False):
    wnid: str
    name: str

@final
class Score:
    """Per-token scores of one text."""

    @property
    def ids(self) -> npt.NDArray[np.uint32]: ...
    @property
    def next_token_logprobs(self) -> npt.NDArray[np.float32]:
        """log p(ids[t+1] | ids[..=t])."""
    @property
    def argmax(self) -> npt.NDArray[np.uint32]: ...
    @property
    def logsumexp(self) -> npt.NDArray[np.float32]: ...
    @property
    def nll(self) -> float: ...
    @property
    def perplexity(self) -> float: ...
    def __len__(self) -> int: ...

@final
class LanguageModel:
    """A TokenFormer language model with its tokenizer."""

    @staticmethod
    def from_pretrained(
        name: str,
        *,
        tokenizer: Optional[_Path] = None,
        config: Optional[_Path] = None,
        weights: str = "f32",
        kv_dtype: str = "f32",
        device: str = "cpu",
        dtype: str = "f32",
    ) -> "LanguageModel": ...
    @property
    def source(self) -> str: ...
    @property
    def max_length(self) -> int: ...
    @property
    def eot_token_id(self) -> int: ...
    def encode(self, text: str) -> List[int]: ...
    def decode(self, ids: List[int]) -> str: ...
    @overload
    def score(self, texts: str) -> Score: ...
    @overload
    def score(self, texts: List[str]) -> List[Score]: ...
    def logits(self, text: Union[str, Sequence[int]]) -> npt.NDArray[np.float32]: ...
    def loglikelihood(self, pairs: List[Tuple[str, str]]) -> List[Tuple[float, bool]]: ...
    def loglikelihood_rolling(self, texts: List[str]) -> List[float]: ...
    @overload
    def generate(
        self,
        prompt: Union[str, List[int]],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: int = 299792458,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        stop: Optional[List[str]] = None,
        batch_size: int = ...,
        details: Literal[False] = False,
    ) -> str: ...
    @overload
    def generate(
        self,
        prompt: Union[str, List[int]],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: int = 299792458,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        stop: Optional[List[str]] = None,
        batch_size: int = ...,
        details: Literal[True],
    ) -> _Generation: ...
    @overload
    def generate(
        self,
        prompt: Union[List[str], List[List[int]]],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: int = 299792458,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        stop: Optional[List[str]] = None,
        batch_size: int = ...,
        details: Literal[False] = False,
    ) -> List[str]: ...
    @overload
    def generate(
        self,
        prompt: Union[List[str], List[List[int]]],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: int = 299792458,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        stop: Optional[List[str]] = None,
        batch_size: int = ...,
        details: Literal[True],
    ) -> List[_Generation]: ...

@final
class ImageClassifier:
    """A TokenFormer image classifier with its preprocessing and class names."""

    @staticmethod
    def from_pretrained(
        name: str,
        *,
        config: Optional[_Path] = None,
        device: str = "cpu",
        dtype: str = "f32",
    ) -> "ImageClassifier": ...
    @property
    def source(self) -> str: ...
    # A str is also a sequence of (one-letter) paths to a type checker; the
    # first overload wins for it, as one path wins at run time.
    @overload
    def classify(self, paths: _Path, k: int = 5) -> List[_Prediction]: ...  # type: ignore[overload-overlap]
    @overload
    def classify(self, paths: Sequence[_Path], k: int = 5) -> List[List[_Prediction]]: ...
    def embed(self, paths: Union[_Path, Sequence[_Path]]) -> npt.NDArray[np.float32]: ...

@final
class ImageTextModel:
    """A merged vision-language TokenFormer with its tokenizer and image preprocessing."""

    @staticmethod
    def from_pretrained(
        name: str,
        *,
        tokenizer: Optional[_Path] = None,
        config: Optional[_Path] = None,
        weights: str = "f32",
        kv_dtype: str = "f32",
        device: str = "cpu",
        dtype: str = "f32",
    ) -> "ImageTextModel": ...
    @property
    def source(self) -> str: ...
    @overload
    def generate(
        self,
        image: _Path,
        prompt: str,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: int = 299792458,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        stop: Optional[List[str]] = None,
        batch_size: int = ...,
        details: Literal[False] = False,
    ) -> str: ...
    @overload
    def generate(
        self,
        image: _Path,
        prompt: str,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: int = 299792458,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        stop: Optional[List[str]] = None,
        batch_size: int = ...,
        details: Literal[True],
    ) -> _Generation: ...
    @overload
    def generate(
        self,
        image: Sequence[_Path],
        prompt: List[str],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: int = 299792458,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        stop: Optional[List[str]] = None,
        batch_size: int = ...,
        details: Literal[False] = False,
    ) -> List[str]: ...
    @overload
    def generate(
        self,
        image: Sequence[_Path],
        prompt: List[str],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: int = 299792458,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        stop: Optional[List[str]] = None,
        batch_size: int = ...,
        details: Literal[True],
    ) -> List[_Generation]: ...
    @overload
    def score(self, image: _Path, text: str) -> Score: ...
    @overload
    def score(self, image: Sequence[_Path], text: List[str]) -> List[Score]: ...
    def loglikelihood(
        self, image: _Path, pairs: List[Tuple[str, str]]
    ) -> List[Tuple[float, bool]]: ...
