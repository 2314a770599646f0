"""`pagoda run-batch`: OpenAI batch files through the offline engine, as `vllm run-batch`.

One output line per request line, in order, with errors in place; greedy outputs equal
`LLM.generate`/`LLM.chat`; `--skip-done` resumes an interrupted run; `-` is stdin/stdout;
the model's generation config supplies unset sampling fields.
"""

from __future__ import annotations

import io
import json
import shutil
import sys

import pytest

from pagoda import LLM, SamplingParams
from pagoda.services.cli.main import main

ENGINE = ["--dtype", "float32", "--block-size", "4", "--max-model-len", "256"]
HELLO = [{"role": "user", "content": "hello there"}]


def request(custom_id, url, body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat(custom_id, **body):
    return request(custom_id, "/v1/chat/completions", {"model": "tiny", "messages": HELLO,
                                                       **body})


def completion(custom_id, prompt, **body):
    return request(custom_id, "/v1/completions", {"model": "tiny", "prompt": prompt, **body})


def write_lines(path, lines) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def run_batch(model, inp, out, *extra) -> int:
    return main(["run-batch", "-i", str(inp), "-o", str(out), "--model", model, *ENGINE,
                 "--served-model-name", "tiny", *extra])


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", block_size=4, max_model_len=256)


GOOD_AND_BAD = [
    chat("chat", max_tokens=6, temperature=0),
    completion("cmpl", ["a b c", "x y"], max_tokens=5, temperature=0, n=2, logprobs=2),
    "{not json",
    "",  # blank: not a request
    request("foo", "/v1/foo", {"model": "tiny"}),
    request("emb", "/v1/embeddings", {"model": "tiny", "input": "hi"}),
    chat("hot", temperature=-1),
    chat("other-model", model="gpt-4"),
    chat("chat", max_tokens=2),  # custom_id repeated
    completion("many-logprobs", "a", logprobs=30),
    request("no-messages", "/v1/chat/completions", {"model": "tiny"}),
    ["not", "an", "object"],
]


def test_a_mix_of_good_and_bad_lines(tmp_path, tiny_llama_dir, llm):
    out = tmp_path / "results.jsonl"
    assert run_batch(tiny_llama_dir, write_lines(tmp_path / "in.jsonl", GOOD_AND_BAD), out) == 0
    lines = read_lines(out)
    assert [line["custom_id"] for line in lines] == [
        "chat", "cmpl", None, "foo", "emb", "hot", "other-model", "chat", "many-logprobs",
        "no-messages", None]
    status = [line["response"]["status_code"] for line in lines]
    assert status == [200, 200, 400, 404, 400, 400, 404, 400, 400, 400, 400]
    errors = [line["error"] for line in lines]
    assert errors[:2] == [None, None]
    assert "line 3 is not valid JSON" in errors[2]["message"]
    assert "/v1/foo" in errors[3]["message"]
    assert "Embeddings API" in errors[4]["message"]  # a generation model cannot embed
    assert "--runner pooling" in errors[4]["message"]
    assert errors[5]["param"] == "temperature"
    assert "gpt-4" in errors[6]["message"] and errors[6]["param"] == "model"
    assert "duplicate custom_id" in errors[7]["message"]
    assert "20" in errors[8]["message"] and errors[8]["param"] == "logprobs"
    assert errors[9]["param"] == "messages"
    assert all(line["response"]["body"] is None for line in lines[2:])
    assert len({line["id"] for line in lines}) == len(lines)

    body = lines[0]["response"]["body"]
    expected = llm.chat(HELLO, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"]["content"] == expected.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == len(expected.outputs[0].token_ids)

    body = lines[1]["response"]["body"]
    expected = llm.generate(["a b c", "x y"], SamplingParams(temperature=0, max_tokens=5),
                            use_tqdm=False)
    texts = [o.outputs[0].text for o in expected]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [texts[0], texts[0], texts[1], texts[1]]
    for choice, output in zip(body["choices"], [expected[0]] * 2 + [expected[1]] * 2):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(output.outputs[0].token_ids)
        assert all(1 <= len(top) <= 3 for top in logprobs["top_logprobs"])
    assert body["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in expected)
    assert body["usage"]["completion_tokens"] == 2 * sum(len(o.outputs[0].token_ids)
                                                         for o in expected)
    assert "prompt_tokens_details" not in body["usage"]


def test_vllm_request_fields_in_a_batch(tmp_path, tiny_llama_dir, llm):
    """priority (vLLM's error under fcfs, in place), truncate_prompt_tokens and bad_words."""
    ids = llm.get_tokenizer().encode("one two three four five six")
    lines = [completion("urgent", "x", max_tokens=2, priority=1),
             completion("cut", "one two three four five six", max_tokens=4, temperature=0,
                        truncate_prompt_tokens=3, bad_words=["seven"])]
    out = tmp_path / "results.jsonl"
    assert run_batch(tiny_llama_dir, write_lines(tmp_path / "in.jsonl", lines), out) == 0
    urgent, cut = read_lines(out)
    assert "Priority scheduling is not enabled" in urgent["error"]["message"]
    expected = llm.generate({"prompt_token_ids": ids[-3:]},
                            SamplingParams(temperature=0, max_tokens=4, bad_words=["seven"]),
                            use_tqdm=False)[0]
    assert cut["response"]["body"]["usage"]["prompt_tokens"] == 3
    assert cut["response"]["body"]["choices"][0]["text"] == expected.outputs[0].text


def test_skip_done_resumes_an_interrupted_run(tmp_path, tiny_llama_dir):
    inp = write_lines(tmp_path / "in.jsonl", [completion(f"r{i}", f"prompt {i}", max_tokens=3,
                                                         temperature=0) for i in range(4)])
    out = tmp_path / "results.jsonl"
    assert run_batch(tiny_llama_dir, inp, out) == 0
    full = out.read_text().splitlines(keepends=True)
    # Killed while writing the third line: two whole lines and a torn one.
    out.write_text(full[0] + full[1] + full[2][:25])
    assert run_batch(tiny_llama_dir, inp, out, "--skip-done") == 0
    lines = read_lines(out)
    assert [line["custom_id"] for line in lines] == ["r0", "r1", "r2", "r3"]
    assert [line["id"] for line in lines[:2]] == [json.loads(x)["id"] for x in full[:2]]
    assert lines[2]["id"] != json.loads(full[2])["id"]  # run again, not kept
    assert [line["response"]["body"]["choices"][0]["text"] for line in lines] == \
        [json.loads(x)["response"]["body"]["choices"][0]["text"] for x in full]
    # Everything done: a third run adds nothing.
    assert run_batch(tiny_llama_dir, inp, out, "--skip-done") == 0
    assert len(read_lines(out)) == 4


def test_stdin_to_stdout(tiny_llama_dir, monkeypatch, capsys):
    text = json.dumps(completion("one", "a b", max_tokens=2, temperature=0)) + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert run_batch(tiny_llama_dir, "-", "-") == 0
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["custom_id"] for line in lines] == ["one"]
    assert lines[0]["response"]["body"]["usage"]["completion_tokens"] == 2


def test_generation_config_fills_unset_fields(tmp_path, tiny_llama_dir, llm):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 4, "top_k": 50}))
    inp = write_lines(tmp_path / "in.jsonl", [chat("c", model=None, ignore_eos=True)])
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", inp, "-o", str(out), "--model", str(model), *ENGINE,
                 "--enable-prompt-tokens-details"]) == 0
    body = read_lines(out)[0]["response"]["body"]
    greedy = llm.chat(HELLO, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0]
    assert body["usage"]["completion_tokens"] == 4  # max_new_tokens
    assert body["choices"][0]["message"]["content"] == greedy.text  # temperature 0: greedy
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert body["model"] == str(model)  # no --served-model-name: the model argument


def test_refuses_trust_remote_code_and_missing_input(tmp_path, tiny_llama_dir, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [chat("c")])
    assert run_batch(tiny_llama_dir, inp, tmp_path / "o.jsonl", "--trust-remote-code") == 2
    assert "Pagoda runs no remote code" in capsys.readouterr().err
    assert run_batch(tiny_llama_dir, tmp_path / "missing.jsonl", tmp_path / "o.jsonl") == 2
    assert "missing.jsonl" in capsys.readouterr().err
