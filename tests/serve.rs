//! `tokenformer serve` on the shipped `tiny-kjv-lm`: each completion is what
//! the library generates for its prompt alone, also when requests arrive
//! together and share the batch; streaming gives the same text token by
//! token; `echo` with `logprobs` gives the prompt's scores as `score` does;
//! the tokenizer endpoints round-trip; bad requests get the API's error body.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};

use serde_json::{json, Value};
use tokenformer::generate::SamplingParams;
use tokenformer::{LanguageModel, PretrainedOptions};

const PROMPT: &str = "And God said unto Moses,";
const NAME: &str = "kjv";

/// A running server, killed when dropped.
struct Serving {
    child: Child,
    base: String,
}

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(extra: &[&str]) -> Serving {
    let model = common::zoo("tiny-kjv-lm");
    let mut child = Command::new(common::bin())
        .args(["serve", "--model", model.to_str().unwrap()])
        .args(["--port", "0", "--served-model-name", NAME])
        .args(extra)
        .env("HF_HUB_OFFLINE", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    let base = line
        .split_whitespace()
        .find_map(|w| w.strip_suffix("/v1"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    // Keep reading, so the server never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    Serving { child, base }
}

fn lm() -> LanguageModel {
    let model = common::zoo("tiny-kjv-lm");
    LanguageModel::from_pretrained(model.to_str().unwrap(), &PretrainedOptions::default()).unwrap()
}

impl Serving {
    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = reqwest::blocking::Client::new()
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .unwrap();
        (r.status().as_u16(), r.json().unwrap())
    }

    fn get(&self, path: &str) -> (u16, Value) {
        let r = reqwest::blocking::get(format!("{}{path}", self.base)).unwrap();
        (r.status().as_u16(), r.json().unwrap())
    }

    fn complete(&self, body: Value) -> Value {
        let (status, v) = self.post("/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        v
    }
}

fn params(temperature: f64, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        seed,
        repeat_last_n: 0,
        ..Default::default()
    }
}

#[test]
fn completions_are_what_each_prompt_gets_alone_also_when_requests_share_the_batch() {
    let server = serve(&["--batch-size", "3"]);
    let lm = lm();
    let v = server
        .complete(json!({"model": NAME, "prompt": PROMPT, "max_tokens": 20, "temperature": 0}));
    let want = lm.generate(PROMPT, 20, params(0.0, 0)).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], NAME);
    assert_eq!(v["choices"][0]["text"], want.as_str());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    let n = lm.encode(PROMPT).unwrap().len();
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": n, "completion_tokens": 20, "total_tokens": n + 20})
    );
    // The same prompt as token ids.
    let ids = lm.encode(PROMPT).unwrap();
    let by_ids = server.complete(json!({"prompt": ids, "max_tokens": 20, "temperature": 0}));
    assert_eq!(by_ids["choices"][0]["text"], want.as_str());

    // Seven requests at once, sampled, with stop strings, decoded three at a
    // time across requests: each gets what the library gives it alone.
    let stop = format!(" {}", want.split_whitespace().nth(3).unwrap());
    let prompts = [
        PROMPT,
        "a handwritten",
        "In the beginning",
        "Jesus",
        "And the LORD",
        "Blessed are",
        "Then",
    ];
    let answers: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (server, stop) = (&server, &stop);
                s.spawn(move || {
                    server.complete(json!({
                        "prompt": p, "max_tokens": 30, "temperature": 0.8, "seed": i, "stop": [stop, "zzz"],
                    }))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut reasons = Vec::new();
    for (i, (p, v)) in prompts.iter().zip(&answers).enumerate() {
        let alone = lm
            .generate_until(p, 30, params(0.8, i as u64), &[stop.as_str(), "zzz"])
            .unwrap();
        assert_eq!(v["choices"][0]["text"], alone.as_str(), "{p}");
        let reason = v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string();
        let tokens = v["usage"]["completion_tokens"].as_u64().unwrap();
        assert_eq!(reason == "length", tokens == 30, "{p}: {v}");
        reasons.push(reason);
    }
    assert!(reasons.iter().any(|r| r == "stop"), "{reasons:?}");
    assert!(reasons.iter().any(|r| r == "length"), "{reasons:?}");

    // Several prompts in one request: a choice each, in order.
    let v = server.complete(json!({"prompt": prompts[..3], "max_tokens": 8, "temperature": 0}));
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, (c, p)) in choices.iter().zip(prompts).enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(
            c["text"],
            lm.generate(p, 8, params(0.0, 0)).unwrap().as_str()
        );
    }
    // echo puts the prompt before the text.
    let v = server
        .complete(json!({"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "echo": true}));
    assert_eq!(v["choices"][0]["text"], format!("{PROMPT}{want}"));
}

/// Server-sent events: a chunk per token whose texts add up to the
/// completion, the finish reason on the last, the usage when asked, `[DONE]`.
#[test]
fn streaming_sends_the_completion_token_by_token() {
    let server = serve(&[]);
    let body = json!({"prompt": PROMPT, "max_tokens": 25, "temperature": 0.7, "seed": 3});
    let whole = server.complete(body.clone());
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    stream_body["stream_options"] = json!({"include_usage": true});
    let mut r = reqwest::blocking::Client::new()
        .post(format!("{}/v1/completions", server.base))
        .json(&stream_body)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let mut raw = String::new();
    r.read_to_string(&mut raw).unwrap();
    let data: Vec<&str> = raw
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("{e:?}")))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let (usage, chunks) = chunks.split_last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"], whole["usage"]);
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
    // One chunk per token, then the end.
    let tokens = whole["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert_eq!(chunks.len(), tokens + 1);
    let reasons: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .collect();
    assert!(reasons[..tokens].iter().all(|r| r.is_null()), "{reasons:?}");
    assert_eq!(reasons[tokens], &whole["choices"][0]["finish_reason"]);
    assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]));
}

/// `echo` with `logprobs`, as lm-evaluation-harness asks for a
/// log-likelihood: the prompt's tokens with `score`'s log-probabilities (the
/// first has none), each with the likeliest alternatives, then the new token.
#[test]
fn echo_with_logprobs_scores_the_prompt_as_score_does() {
    let server = serve(&[]);
    let lm = lm();
    let text = "In the beginning God created the heaven and the earth.";
    let k = 3;
    let v = server.complete(json!({
        "prompt": text, "max_tokens": 1, "temperature": 0, "logprobs": k, "echo": true,
    }));
    let lp = &v["choices"][0]["logprobs"];
    let score = lm.score(text).unwrap();
    let n = score.ids.len();
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), n + 1);
    for (t, &id) in tokens.iter().zip(&score.ids) {
        assert_eq!(t, lm.decode(&[id]).unwrap().as_str());
    }
    assert_eq!(lp["token_logprobs"][0], Value::Null);
    assert_eq!(lp["top_logprobs"][0], Value::Null);
    let mut outside = false;
    for t in 1..n {
        let got = lp["token_logprobs"][t].as_f64().unwrap();
        let want = f64::from(score.next_token_logprobs[t - 1]);
        assert!((got - want).abs() < 1e-5, "position {t}: {got} vs {want}");
        // The alternatives: k of them (plus the token itself when it is not
        // among them), the likeliest being the argmax `score` reports.
        let top = lp["top_logprobs"][t].as_object().unwrap();
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        let argmax = lm.decode(&[score.argmax[t - 1]]).unwrap();
        assert_eq!(top[&argmax].as_f64().unwrap(), best, "position {t}");
        // The token itself is listed, as the k+1-th when it is not among the k.
        assert_eq!(top[tokens[t].as_str().unwrap()].as_f64().unwrap(), got);
        let above = top.values().filter(|x| x.as_f64().unwrap() > got).count();
        assert_eq!(
            top.len(),
            if above < k { k } else { k + 1 },
            "position {t}: {top:?}"
        );
        let is_greedy = score.argmax[t - 1] == score.ids[t];
        assert_eq!(got == best, is_greedy, "position {t}");
        outside |= above >= k;
    }
    assert!(
        outside,
        "some token of the text should be outside the likeliest {k}"
    );
    // The new token: greedy, so the likeliest, and the text after the prompt.
    let new = &lp["top_logprobs"][n];
    let best = new
        .as_object()
        .unwrap()
        .values()
        .map(|x| x.as_f64().unwrap())
        .fold(f64::MIN, f64::max);
    assert_eq!(lp["token_logprobs"][n].as_f64().unwrap(), best);
    let offsets = lp["text_offset"].as_array().unwrap();
    let out = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(offsets[0], 0);
    assert_eq!(offsets[n], text.chars().count());
    assert_eq!(out, format!("{text}{}", tokens[n].as_str().unwrap()));
}

#[test]
fn tokenizer_endpoints_round_trip_and_bad_requests_are_refused_by_name() {
    let server = serve(&[]);
    let lm = lm();
    let (status, info) = server.get("/tokenizer_info");
    assert_eq!(status, 200);
    let eos = info["eos_token"].as_str().unwrap();
    let (_, t) = server.post("/tokenize", &json!({"prompt": eos}));
    assert_eq!(t["tokens"], json!([lm.model().config().eos_token_id]));
    let (status, t) = server.post("/tokenize", &json!({"prompt": PROMPT}));
    assert_eq!(status, 200);
    assert_eq!(t["tokens"], json!(lm.encode(PROMPT).unwrap()));
    assert_eq!(t["count"], lm.encode(PROMPT).unwrap().len());
    let (_, d) = server.post("/detokenize", &json!({"tokens": t["tokens"]}));
    assert_eq!(d["prompt"], PROMPT);
    let (status, models) = server.get("/v1/models");
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], NAME);
    assert_eq!(server.get("/health").0, 200);

    let vocab = lm.model().config().vocab_size;
    let long: Vec<u32> = vec![5; lm.model().config().max_position_embeddings];
    let huge = "a".repeat(1 << 20);
    let bad: [(Value, u16, &str); 10] = [
        (json!({ "prompt": huge }), 400, "1048576 bytes"),
        (
            json!({"prompt": PROMPT, "model": "gpt-4"}),
            404,
            "`gpt-4` does not exist",
        ),
        (json!({"prompt": PROMPT, "n": 2}), 400, "`n`"),
        (json!({"prompt": PROMPT, "logprobs": 50}), 400, "`logprobs`"),
        (
            json!({"prompt": PROMPT, "temperature": -1}),
            400,
            "temperature",
        ),
        (json!({"prompt": []}), 400, "empty list"),
        (json!({"prompt": [PROMPT, ""]}), 400, "prompt #2"),
        (json!({"prompt": [1, vocab]}), 400, &format!("{vocab}")),
        (json!({"prompt": long}), 400, "context"),
        (json!({"max_tokens": 3}), 400, "prompt"),
    ];
    for (body, status, needle) in bad {
        let (got, v) = server.post("/v1/completions", &body);
        assert_eq!(got, status, "{body}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{body}: {message}");
    }
    let (status, v) = server.post("/detokenize", &json!({"tokens": [u32::MAX]}));
    assert_eq!(status, 400, "{v}");
    let r = reqwest::blocking::Client::new()
        .post(format!("{}/v1/completions", server.base))
        .body("{not json")
        .send()
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(server.get("/v2/nothing").0, 404);
    // The server is still there after all that.
    let v = server.complete(json!({"prompt": PROMPT, "max_tokens": 2}));
    assert_eq!(v["usage"]["completion_tokens"], 2);
}
