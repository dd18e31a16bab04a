"""`jaxserve chat` and `jaxserve complete` against a running server: replies stream to stdout,
the chat keeps its conversation, and the text is what the offline engine writes."""

from __future__ import annotations

import io

from jaxserve import SamplingParams
from jaxserve.entrypoints.cli.main import main
from server_helpers import API_KEY


def test_complete_quick_prints_the_greedy_completion(served, offline, capsys):
    assert main(["complete", "--url", f"{served.url}/v1", "--api-key", API_KEY,
                 "-q", "Once upon a time", "--max-tokens", "5", "--temperature", "0"]) == 0
    want = offline.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5),
                            use_tqdm=False)[0].outputs[0].text
    assert capsys.readouterr().out == want + "\n"


def test_chat_keeps_the_conversation_over_turns(served, offline, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello robot\nAnd the sea?\n"))
    assert main(["chat", "--url", f"{served.url}/v1", "--api-key", API_KEY,
                 "--system-prompt", "Be brief.", "--max-tokens", "4",
                 "--temperature", "0"]) == 0
    greedy = SamplingParams(temperature=0, max_tokens=4)
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hello robot"}]
    first = offline.chat(conversation, greedy, use_tqdm=False)[0].outputs[0].text
    conversation += [{"role": "assistant", "content": first},
                     {"role": "user", "content": "And the sea?"}]
    second = offline.chat(conversation, greedy, use_tqdm=False)[0].outputs[0].text
    assert capsys.readouterr().out == f"{first}\n{second}\n"


def test_a_server_that_is_not_there_or_refuses_is_a_clear_error(served, capsys):
    assert main(["complete", "--url", "http://127.0.0.1:9/v1", "-q", "x"]) == 2
    assert "cannot reach the server at http://127.0.0.1:9/v1" in capsys.readouterr().err
    assert main(["chat", "--url", f"{served.url}/v1", "-q", "x"]) == 2
    assert "HTTP 401" in capsys.readouterr().err
