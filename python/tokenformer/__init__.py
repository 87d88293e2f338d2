"""TokenFormer models on the Rust/candle engine of the `tokenformer` toolkit.

    import tokenformer
    lm = tokenformer.LanguageModel.from_pretrained("tokenformer-150m")
    s = lm.score("The capital of France is Paris.")
    print(s.perplexity, s.next_token_logprobs)      # numpy float32
    print(lm.generate("The capital of France is", max_new_tokens=8))

    clf = tokenformer.ImageClassifier.from_pretrained("tiny-digits-vit")
    print(clf.classify(["digit.png"]))

    vl = tokenformer.ImageTextModel.from_pretrained("tiny-digits-vl")
    print(vl.generate("digit.png", "a handwritten", max_new_tokens=2))

`tokenformer.harness` holds an lm-evaluation-harness model adapter.
Compute releases the GIL; errors are `TokenFormerError` with the library's message.
"""

from ._tokenformer import (
    ImageClassifier,
    ImageTextModel,
    LanguageModel,
    Score,
    TokenFormerError,
)

__all__ = ["ImageClassifier", "ImageTextModel", "LanguageModel", "Score", "TokenFormerError"]
