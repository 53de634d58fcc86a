"""`q3tts voices list|add|delete` against a live Base server (the voice store the web page uses)."""

import json

from q3tts.cli import main

from .test_voices import REF_TEXT, reference_wav


def test_cli_voices_on_a_server(base_server, tmp_path, capsys):
    clip = tmp_path / "ref.wav"
    clip.write_bytes(reference_wav(2.0, 180.0, seed=3))
    srv = ["--server", base_server.base_url]
    assert main(["voices", "add", "cli-dave", "--ref-audio", str(clip), "--ref-text", REF_TEXT, *srv]) == 0
    vid = capsys.readouterr().out.strip()
    with base_server.http() as h:
        listed = {v["id"]: v for v in h.get("/v1/audio/voices").json()["data"]}
    assert listed[vid]["name"] == "cli-dave" and listed[vid]["mode"] == "icl"
    assert main(["voices", "list", "--json", *srv]) == 0
    assert {v["id"] for v in json.loads(capsys.readouterr().out)} == set(listed)
    assert main(["voices", "list", *srv]) == 0
    assert f"{vid}\tcli-dave\ticl" in capsys.readouterr().out
    # the server's refusal, in its words
    assert main(["voices", "add", "cli-dave", "--ref-audio", str(clip), "--x-vector-only", *srv]) == 2
    assert "server: a voice named 'cli-dave' already exists" in capsys.readouterr().err
    assert main(["voices", "delete", "cli-dave", *srv]) == 0
    assert f"deleted {vid}" in capsys.readouterr().err
    with base_server.http() as h:
        assert vid not in {v["id"] for v in h.get("/v1/audio/voices").json()["data"]}
    assert main(["voices", "delete", "cli-dave", *srv]) == 2
    assert "server: no voice 'cli-dave'" in capsys.readouterr().err
    # no server there
    assert main(["voices", "list", "--server", "http://127.0.0.1:9"]) == 2
    assert "cannot reach the server at http://127.0.0.1:9" in capsys.readouterr().err
