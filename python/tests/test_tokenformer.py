"""The Python package against the `tokenformer` command line (the same engine
must give the same numbers) and against lm-evaluation-harness's own API."""

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tokenformer

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("TOKENFORMER_BIN", ROOT / "target" / "release" / "tokenformer"))
KJV = str(ROOT / "zoo" / "tiny-kjv-lm")
DIGITS = str(ROOT / "zoo" / "tiny-digits-vit")
DIGITS_VL = str(ROOT / "zoo" / "tiny-digits-vl")
EXAMPLES = ROOT / "zoo" / "examples" / "digits"
# What `details=True` returns: a `generate --prompts` line without its `line` and `prompt`.
GENERATION_KEYS = ("generated_text", "finish_reason", "prompt_tokens", "generated_tokens")
TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
]


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([str(BIN), *args], capture_output=True, text=True, env=env)
    if check:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def lm():
    return tokenformer.LanguageModel.from_pretrained(KJV)


def test_score_equals_the_cli(lm):
    for text in TEXTS:
        want = json.loads(cli("score", "--model", KJV, "--text", text, "--json").stdout)
        got = lm.score(text)
        assert got.ids.dtype == np.uint32 and got.next_token_logprobs.dtype == np.float32
        assert got.ids.tolist() == want["ids"]
        np.testing.assert_array_equal(got.next_token_logprobs, np.array(want["next_token_logprobs"], np.float32))
        assert got.argmax.tolist() == want["argmax"]
        assert got.nll == pytest.approx(want["nll"], rel=1e-12)
        assert got.perplexity == pytest.approx(want["perplexity"], rel=1e-12)
    many = lm.score(TEXTS)
    assert [s.nll for s in many] == [lm.score(t).nll for t in TEXTS]


def test_logits_are_pytorchs_and_give_the_scores():
    fixtures = ROOT / "tests" / "fixtures"
    tiny = tokenformer.LanguageModel.from_pretrained(
        str(fixtures / "official-lm-tiny"), tokenizer=str(fixtures / "gpt-neox-20b-tokenizer.json")
    )
    exp = json.loads((fixtures / "official-lm-tiny" / "expected.json").read_text())
    logits = tiny.logits(exp["ids"])
    assert logits.dtype == np.float32 and logits.shape[0] == len(exp["ids"])
    # PyTorch's logits of vocabulary ids 0..8 at every position (the official semantics).
    np.testing.assert_allclose(logits[:, :8], exp["logits_first8"], atol=1e-4)
    # The text gives its own ids' logits; log-softmax of them is what `score` reports.
    np.testing.assert_array_equal(tiny.logits(exp["text"]), tiny.logits(tiny.encode(exp["text"])))
    m = logits.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]
    s = tiny.score(exp["text"])
    assert list(s.ids) == exp["ids"]
    picked = logits[np.arange(len(exp["ids"]) - 1), exp["ids"][1:]] - lse[:-1]
    np.testing.assert_allclose(picked, s.next_token_logprobs, atol=1e-4)
    np.testing.assert_allclose(lse[:-1], s.logsumexp[: len(picked)], rtol=1e-5)
    for bad, msg in (([], "no tokens"), ([10**9], "outside the model's vocabulary")):
        with pytest.raises(tokenformer.TokenFormerError, match=msg):
            tiny.logits(bad)


def test_generate_equals_the_cli(lm):
    prompt = "And God said unto Moses,"
    out = cli("generate", "--model", KJV, "--prompt", prompt, "--max-new-tokens", "30").stdout
    assert lm.generate(prompt, 30) + "\n" == out[len(prompt):]
    stop = out[len(prompt):].split()[2]
    out = cli("generate", "--model", KJV, "--prompt", prompt, "--max-new-tokens", "30", "--stop", stop).stdout
    assert lm.generate(prompt, 30, stop=[stop]) + "\n" == out[len(prompt):]
    sampled = dict(temperature=0.8, top_k=20, seed=7, repeat_penalty=1.3, repeat_last_n=16)
    out = cli(
        "generate", "--model", KJV, "--prompt", prompt, "--max-new-tokens", "20",
        "--temperature", "0.8", "--top-k", "20", "--seed", "7",
        "--repeat-penalty", "1.3", "--repeat-last-n", "16",
    ).stdout
    assert lm.generate(prompt, 20, **sampled) + "\n" == out[len(prompt):]
    # A prompt in token ids continues the same way.
    assert lm.generate(lm.encode(prompt), 30) == lm.generate(prompt, 30)


def test_a_list_of_prompts_generates_as_the_cli_does(lm, tmp_path):
    prompts = ["And God said unto Moses,", "a handwritten", "In the beginning", "Jesus"]
    opts = ["--max-new-tokens", "20", "--temperature", "0.8", "--top-k", "20", "--seed", "7", "--stop", "LORD"]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    lines = cli("generate", "--model", KJV, "--prompts", str(data), "--quiet", *opts).stdout.splitlines()
    want = [json.loads(line)["generated_text"] for line in lines]
    sampled = dict(temperature=0.8, top_k=20, seed=7, stop=["LORD"])
    for batch_size in (1, 3):
        assert lm.generate(prompts, 20, batch_size=batch_size, **sampled) == want
    # Each the text it gets alone.
    assert want == [lm.generate(p, 20, **sampled) for p in prompts]
    # details=True: the CLI's line without its `line` and `prompt`.
    full = [{k: json.loads(line)[k] for k in GENERATION_KEYS} for line in lines]
    assert {d["finish_reason"] for d in full} >= {"stop_sequence", "length"}, full
    assert lm.generate(prompts, 20, details=True, **sampled) == full
    assert lm.generate(prompts[0], 20, details=True, **sampled) == full[0]
    assert lm.generate(lm.encode(prompts[1]), 20, details=True, **sampled) == full[1]


def test_classify_equals_the_cli():
    clf = tokenformer.ImageClassifier.from_pretrained(DIGITS)
    images = sorted(str(p) for p in (EXAMPLES / "seven").iterdir())[:2] + sorted(
        str(p) for p in (EXAMPLES / "three").iterdir()
    )[:1]
    want = json.loads(cli("classify", "--model", DIGITS, "--json", *images).stdout)
    got = clf.classify(images, k=5)
    assert len(got) == 3
    for g, w in zip(got, want):
        assert [p["index"] for p in g] == [p["index"] for p in w["top5"]]
        assert [p["name"] for p in g] == [p["name"] for p in w["top5"]]
        np.testing.assert_allclose([p["prob"] for p in g], [p["prob"] for p in w["top5"]], rtol=1e-6)
    assert clf.classify(images[0], k=1)[0]["name"] == "seven"
    # An unreadable file is an error naming it once, as the command line's.
    with pytest.raises(tokenformer.TokenFormerError) as e:
        clf.classify([images[0], __file__])
    assert str(e.value) == f"{__file__}: not a JPEG, PNG or WebP image (unrecognised contents)"


def test_embed_equals_the_cli_and_its_head_classifies(tmp_path):
    from safetensors import safe_open

    clf = tokenformer.ImageClassifier.from_pretrained(DIGITS)
    images = [str(p) for d in ("seven", "three") for p in sorted((EXAMPLES / d).iterdir())[:2]]
    out = tmp_path / "emb.safetensors"
    cli("embed", "--model", DIGITS, "--out", str(out), *images)
    # The command's file, read by the safetensors package as any user would.
    with safe_open(str(out), "np") as f:
        want = f.get_tensor("embeddings")
        assert json.loads(f.metadata()["files"]) == images
    got = clf.embed(images)
    assert got.dtype == np.float32 and got.shape == want.shape == (4, want.shape[1])
    np.testing.assert_array_equal(got, want)
    one = clf.embed(images[0])
    assert one.shape == (want.shape[1],)
    np.testing.assert_allclose(one, got[0], rtol=1e-5, atol=1e-6)
    # The head of an embedding is the classifier's answer.
    with safe_open(str(Path(DIGITS) / "model.safetensors"), "np") as f:
        w, b = f.get_tensor("head.weight"), f.get_tensor("head.bias")
    top = [c[0]["index"] for c in clf.classify(images, k=1)]
    assert list(np.argmax(got @ w.T + b, axis=1)) == top
    with pytest.raises(tokenformer.TokenFormerError) as e:
        clf.embed([images[0], __file__])
    assert str(e.value) == f"{__file__}: not a JPEG, PNG or WebP image (unrecognised contents)"


def test_image_text_model_generates_as_the_cli_does(tmp_path):
    vl = tokenformer.ImageTextModel.from_pretrained(DIGITS_VL)
    images = [EXAMPLES / d / "0015.png" for d in ("four", "zero", "six")]
    prompts = ["a handwritten", "a handwritten", "a"]
    lines = tmp_path / "prompts.jsonl"
    lines.write_text("".join(json.dumps({"prompt": p, "image": str(i)}) + "\n" for p, i in zip(prompts, images)))
    args = ("--model", DIGITS_VL, "--max-new-tokens", "3")
    want = [json.loads(l) for l in cli("generate", *args, "--prompts", str(lines), "--quiet").stdout.splitlines()]
    for w, i, p in zip(want, images, prompts):
        alone = cli("generate", *args, "--prompt", p, "--image", str(i)).stdout
        assert alone == p + w["generated_text"] + "\n"
        assert vl.generate(i, p, 3) == w["generated_text"]  # a pathlib.Path, as a str
        assert vl.generate(str(i), p, 3, details=True) == {k: w[k] for k in GENERATION_KEYS}
    assert want[0]["generated_text"].startswith(" four")
    assert vl.generate(images, prompts, 3, batch_size=2) == [w["generated_text"] for w in want]
    got = vl.generate([str(i) for i in images], prompts, 3, details=True)
    assert got == [{k: w[k] for k in GENERATION_KEYS} for w in want]
    for opts in (dict(dtype="bf16"), dict(weights="f16")):
        half = tokenformer.ImageTextModel.from_pretrained(DIGITS_VL, **opts)
        assert half.generate(images, prompts, 3) == [w["generated_text"] for w in want]
    with pytest.raises(tokenformer.TokenFormerError, match="8-bit weights quantise language models only"):
        tokenformer.ImageTextModel.from_pretrained(DIGITS_VL, weights="q8")
    with pytest.raises(tokenformer.TokenFormerError, match="one path with one prompt"):
        vl.generate(images, "a handwritten")  # type: ignore[call-overload]
    with pytest.raises(tokenformer.TokenFormerError, match="2 images for 3 prompts"):
        vl.generate(images[:2], prompts)
    with pytest.raises(tokenformer.TokenFormerError, match="is not a vision-language model"):
        tokenformer.ImageTextModel.from_pretrained(KJV)


def test_image_text_model_scores_as_the_cli_does():
    vl = tokenformer.ImageTextModel.from_pretrained(DIGITS_VL)
    seven, three = EXAMPLES / "seven" / "0005.png", EXAMPLES / "three" / "0005.png"
    text = "a handwritten seven"
    want = json.loads(cli("score", "--model", DIGITS_VL, "--image", str(seven), "--text", text, "--json").stdout)
    got = vl.score(seven, text)
    assert got.ids.tolist() == want["ids"]
    np.testing.assert_array_equal(got.next_token_logprobs, np.array(want["next_token_logprobs"], np.float32))
    assert got.argmax.tolist() == want["argmax"]
    assert got.nll == pytest.approx(want["nll"], rel=1e-12)
    both = vl.score([str(seven), three], [text, text])
    assert both[0].nll == got.nll and both[1].nll > got.nll + 1
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    ll = vl.loglikelihood(seven, [("a handwritten", " " + n) for n in names])
    assert [g for _, g in ll] == [n == "seven" for n in names]
    assert max(range(10), key=lambda i: ll[i][0]) == names.index("seven")
    assert ll[names.index("seven")][0] == pytest.approx(got.next_token_logprobs[-1], abs=1e-5)
    with pytest.raises(tokenformer.TokenFormerError, match="one path with one text"):
        vl.score([seven], text)  # type: ignore[call-overload]
    with pytest.raises(tokenformer.TokenFormerError, match="2 images for 1 texts"):
        vl.score([seven, three], [text])
    with pytest.raises(tokenformer.TokenFormerError, match="missing.png"):
        vl.loglikelihood(EXAMPLES / "missing.png", [("a", " b")])


def test_errors_carry_the_library_message(tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text('{"architecture": "tokenformer-lm", "hidden_size": "x"}')
    with pytest.raises(tokenformer.TokenFormerError) as e:
        tokenformer.LanguageModel.from_pretrained(str(bad))
    r = cli("score", "--model", str(bad), "--text", "a b c", check=False)
    assert r.returncode == 1
    assert str(e.value) in r.stderr
    assert "model.safetensors" in str(e.value)
    with pytest.raises(tokenformer.TokenFormerError, match="weights must be"):
        tokenformer.LanguageModel.from_pretrained(KJV, weights="int4")
    with pytest.raises(tokenformer.TokenFormerError, match='kv_dtype must be "f32" or "f16", not "bf16"'):
        tokenformer.LanguageModel.from_pretrained(KJV, kv_dtype="bf16")
    lm = tokenformer.LanguageModel.from_pretrained(KJV)
    with pytest.raises(tokenformer.TokenFormerError, match="`temperature` must be a finite number"):
        lm.generate("And", temperature=float("nan"))
    with pytest.raises(tokenformer.TokenFormerError, match="`top_p` must be between 0 and 1, got 2"):
        lm.generate("And", temperature=0.8, top_p=2.0)


def test_an_f16_kv_cache_generates_as_the_cli_does():
    lm = tokenformer.LanguageModel.from_pretrained(KJV, kv_dtype="f16")
    got = lm.generate("And God said", 24)
    r = cli("generate", "--model", KJV, "--prompt", "And God said", "--max-new-tokens", "24", "--kv-dtype", "f16")
    assert r.stdout == "And God said" + got + "\n"


def test_device_is_the_cpu_and_other_devices_are_refused_as_by_the_cli():
    lm = tokenformer.LanguageModel.from_pretrained(KJV, device="cpu")
    assert lm.score(TEXTS[0]).nll == tokenformer.LanguageModel.from_pretrained(KJV).score(TEXTS[0]).nll
    tokenformer.ImageClassifier.from_pretrained(DIGITS, device="cpu")
    with pytest.raises(tokenformer.TokenFormerError, match="unknown device `gpu`"):
        tokenformer.LanguageModel.from_pretrained(KJV, device="gpu")
    # The wheel CI builds has no CUDA: the error says how to build it, as the CLI's does.
    with pytest.raises(tokenformer.TokenFormerError, match="no CUDA support") as e:
        tokenformer.ImageClassifier.from_pretrained(DIGITS, device="cuda:0")
    r = cli("classify", "--model", DIGITS, "--device", "cuda:0", str(EXAMPLES / "seven" / "0005.png"), check=False)
    assert r.returncode == 1
    assert str(e.value) in r.stderr


def test_dtype_bf16_computes_close_to_f32_and_a_bad_dtype_is_named():
    text = " ".join(TEXTS)
    f32 = tokenformer.LanguageModel.from_pretrained(KJV).score(text).perplexity
    bf16 = tokenformer.LanguageModel.from_pretrained(KJV, dtype="bf16").score(text).perplexity
    assert bf16 != f32
    assert abs(bf16 / f32 - 1) < 0.005
    with pytest.raises(tokenformer.TokenFormerError, match="unknown dtype `f8`"):
        tokenformer.LanguageModel.from_pretrained(KJV, dtype="f8")
    with pytest.raises(tokenformer.TokenFormerError, match="apply to f32 computation"):
        tokenformer.LanguageModel.from_pretrained(KJV, dtype="bf16", weights="q8")


def test_compute_releases_the_gil(lm):
    text = " ".join(TEXTS * 40)
    done = threading.Event()

    def work():
        for _ in range(3):
            lm.loglikelihood_rolling([text])
        done.set()

    t = threading.Thread(target=work)
    start = time.perf_counter()
    t.start()
    spins = 0
    while not done.is_set():
        spins += 1
    t.join()
    # With the GIL held for the whole call this thread could not spin at all.
    assert spins > 10_000, (spins, time.perf_counter() - start)


class Req:
    """The harness's Instance, as far as an LM reads it."""

    def __init__(self, *args):
        self.args = args


def by_hand_loglikelihood(lm, context, continuation):
    ctx, whole = lm.encode(context), lm.encode(context + continuation)
    n = len(whole) - len(ctx)
    s = lm.score(context + continuation)
    logprob = float(np.sum(s.next_token_logprobs[-n:].astype(np.float64)))
    greedy = s.argmax[-n:].tolist() == whole[-n:]
    return logprob, greedy


def test_harness_adapter_requests(lm):
    from tokenformer.harness import TokenFormerLM

    h = TokenFormerLM(model=lm, batch_size=4, device="cpu")
    pairs = [("And God said", " unto Moses"), ("In the beginning", " God created"), ("Jesus", " wept")]
    got = h.loglikelihood([Req(c, x) for c, x in pairs])
    for (lp, greedy), (c, x) in zip(got, pairs):
        want_lp, want_greedy = by_hand_loglikelihood(lm, c, x)
        assert lp == pytest.approx(want_lp, abs=1e-4)
        assert greedy == want_greedy
    # Rolling: one window here, every token given the end-of-text token first.
    eot = lm.decode([h.eot_token_id])
    for text in TEXTS:
        (rolled,) = h.loglikelihood_rolling([Req(text)])
        s = lm.score(eot + text)
        assert s.ids[0] == h.eot_token_id
        assert rolled == pytest.approx(float(np.sum(s.next_token_logprobs.astype(np.float64))), abs=1e-4)
    # Longer than the context (256 tokens): windows still score every token once.
    long = " ".join(TEXTS * 20)
    n = len(lm.encode(long))
    assert n > h.max_length
    (rolled,) = h.loglikelihood_rolling([Req(long)])
    assert rolled < 0 and np.isfinite(rolled)
    # generate_until stops before the first `until` string and honours max_gen_toks.
    prompt = "And God said unto Moses,"
    free = lm.generate(prompt, 30)
    word = free.split()[3]
    (text,) = h.generate_until([Req(prompt, {"until": [word], "max_gen_toks": 30})])
    assert text == free[: free.index(word)]
    (short,) = h.generate_until([Req(prompt, {"until": ["zzzz"], "max_gen_toks": 5})])
    assert len(lm.encode(short)) <= 5 and free.startswith(short)
    # Many requests: those with the same settings are decoded together, each
    # answer in its request's place and what it gets alone.
    settings = [{"until": ["."], "max_gen_toks": 12}, {"until": [","], "max_gen_toks": 6}]
    reqs = [Req(c, settings[i % 2]) for i, c in enumerate(["And God said", "Jesus", "a handwritten", prompt, "In the"])]
    texts = h.generate_until(reqs)
    assert texts == [h.generate_until([r])[0] for r in reqs]
    assert texts[0] == lm.generate("And God said", 12, stop=["."])


def test_through_the_harness(tmp_path, lm):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import LM
    from lm_eval.api.registry import get_model

    import tokenformer.harness  # noqa: F401  (registers "tokenformer")

    cls = get_model("tokenformer")
    assert issubclass(cls, LM)
    h = cls.create_from_arg_string(f"pretrained={KJV},weights=f32", {"batch_size": 8, "device": "cpu"})
    req = Instance(request_type="loglikelihood", doc={}, arguments=("And God said", " unto Moses"), idx=0)
    ((lp, greedy),) = h.loglikelihood([req])
    assert lp == pytest.approx(by_hand_loglikelihood(lm, "And God said", " unto Moses")[0], abs=1e-4)

    # A whole harness run on a local multiple-choice task.
    data = tmp_path / "kjv_mc.jsonl"
    docs: list[dict[str, Any]] = [
        {"q": "In the beginning God created the heaven and the", "choices": ["earth.", "fish.", "bread."], "gold": 0},
        {"q": "And God said, Let there be", "choices": ["spoons", "light:", "wheels"], "gold": 1},
    ]
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "kjv_mc.yaml").write_text(
        "task: kjv_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n"
    )
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=h, tasks=["kjv_mc"], task_manager=TaskManager(include_path=str(tmp_path))
    )
    acc = results["results"]["kjv_mc"]["acc,none"]
    # The same decision by hand: the choice (after the harness's " " delimiter)
    # with the highest log-likelihood.
    want = np.mean([
        int(np.argmax([by_hand_loglikelihood(lm, d["q"], " " + c)[0] for c in d["choices"]]) == d["gold"])
        for d in docs
    ])
    assert acc == pytest.approx(want)


@pytest.fixture()
def served():
    """`tokenformer serve` on the shipped model, on a free port: its base URL."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    args = [str(BIN), "serve", "--model", KJV, "--port", "0", "--served-model-name", "kjv"]
    p = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
    assert p.stderr is not None
    line = p.stderr.readline()
    base = next(w[: -len("/v1")] for w in line.split() if w.endswith("/v1"))
    threading.Thread(target=p.stderr.read, daemon=True).start()
    yield base
    p.kill()
    p.wait()


def test_the_harness_runs_on_serve_as_on_the_library(served, lm):
    """lm-evaluation-harness's `local-completions` model (OpenAI completions API,
    its tokenizer read from the server) gets the library's log-likelihoods,
    greedy flags and generations."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    # Registering ours must leave the harness's own models findable.
    import tokenformer.harness  # noqa: F401

    assert get_model("tokenformer") is tokenformer.harness.TokenFormerLM
    h = get_model("local-completions")(
        base_url=f"{served}/v1/completions", model="kjv", max_length=255, tokenizer_backend="auto"
    )
    assert type(h.tokenizer).__name__ == "RemoteTokenizer"
    prompt = "And God said unto Moses,"
    free = lm.generate(prompt, 30)
    # The last pair is the model's own greedy continuation.
    pairs = [("And God said", " unto Moses"), ("In the beginning", " God created"), (prompt, lm.generate(prompt, 3))]
    reqs = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)
    ]
    for (lp, greedy), (c, x) in zip(h.loglikelihood(reqs), pairs):
        want_lp, want_greedy = by_hand_loglikelihood(lm, c, x)
        assert lp == pytest.approx(want_lp, abs=1e-4)
        assert greedy == want_greedy
    assert [by_hand_loglikelihood(lm, c, x)[1] for c, x in pairs] == [False, False, True]
    word = free.split()[3]
    # A text within one window: every token given the end-of-text token first, as the adapter scores it.
    rolling = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=i) for i, t in enumerate(TEXTS)]
    for got, text in zip(h.loglikelihood_rolling(rolling), TEXTS):
        s = lm.score(lm.decode([h.eot_token_id]) + text)
        assert got == pytest.approx(float(np.sum(s.next_token_logprobs.astype(np.float64))), abs=1e-4)
    gen = Instance(request_type="generate_until", doc={}, arguments=(prompt, {"until": [word], "max_gen_toks": 30}), idx=0)
    (text,) = h.generate_until([gen])
    assert text == free[: free.index(word)]
