from pathlib import Path


def test_greeting_exists():
    assert Path("greeting.txt").is_file()


def test_greeting_content():
    assert Path("greeting.txt").read_text() == "hello, sandbox\n"


def test_done_marker():
    done = Path("out/done")
    assert done.is_file() and done.stat().st_size == 0
