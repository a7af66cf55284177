"""No credential written into a URL reaches any output: a password in an endpoint's userinfo, and
query parameters named like a key or token, are cut out of the ledger, the engine logs, the
terminal, JUnit XML, the Markdown and HTML reports, the history and the exports; the endpoint up
(the real llama-server behind it) and down."""

from __future__ import annotations

import pytest

from pytest_gpubench.cli.main import main
from pytest_gpubench.core.secrets import SecretScrubber, scrub_url_credentials
from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.ledger.writer import read_ledger

PASSWORD = "hunter2-Zq7"
PROMPTS = 'prompts:\n  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}\n'
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http://bench:pw-1234@127.0.0.1:8080/v1", "http://bench:[REDACTED]@127.0.0.1:8080/v1"),
        ("GET https://ghp_abcd1234@github.com/x", "GET https://[REDACTED]@github.com/x"),
        ("http://h:1/v1?api_key=k123&model=m", "http://h:1/v1?api_key=[REDACTED]&model=m"),
        ("http://h/?access_token=t1&X-Amz-Signature=s1", None),
        ('{"engine_url": "http://u:p%40ss@h:1"}', '{"engine_url": "http://u:[REDACTED]@h:1"}'),
        ("ssh://bench@host:22 and user@host", "ssh://bench@host:22 and user@host"),
        ("http://127.0.0.1:9/health?design=1", "http://127.0.0.1:9/health?design=1"),
    ],
)
def test_credentials_written_into_urls_are_scrubbed(text: str, expected: str | None) -> None:
    scrubbed = SecretScrubber([])(text)
    assert scrubbed == scrub_url_credentials(text)
    if expected is None:
        assert "t1" not in scrubbed and "s1" not in scrubbed and scrubbed.count("[REDACTED]") == 2
    else:
        assert scrubbed == expected


def every_output(pytester: pytest.Pytester, endpoint: str) -> tuple[str, list[dict[str, object]]]:
    """Run one cell on `endpoint`, then every report and export of its ledger; the terminal
    text and the ledger's records."""
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{endpoint}', runs: 2}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = pytester.runpytest(
        "--force-load", "-p", "no:cacheprovider", "-rA", "-v", "--junitxml=junit.xml"
    )
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    reports = pytester.path / "reports"
    for argv in (
        ["report", str(ledger), "-o", str(reports / "report.md")],
        ["report", str(ledger), "--html", "-o", str(reports / "report.html")],
        ["history", str(ledger.parent), "-o", str(reports / "history.txt")],
        ["history", str(ledger.parent), "--html", "-o", str(reports / "history.html")],
        [
            "export",
            str(ledger),
            "--prometheus",
            str(reports / "gpubench.prom"),
            "--csv",
            str(reports / "calls.csv"),
            "--json",
            str(reports / "summary.json"),
        ],
    ):
        reports.mkdir(exist_ok=True)
        assert main(argv) in (0, 6, 7), argv
    terminal = result.stdout.str() + result.stderr.str()
    return terminal, read_ledger(ledger)


def assert_nowhere(pytester: pytest.Pytester, terminal: str) -> None:
    assert PASSWORD not in terminal
    written = [path for path in pytester.path.rglob("*") if path.is_file()]
    names = {path.name for path in written}
    assert {"junit.xml", "report.md", "report.html", "calls.csv", "summary.json"} <= names
    assert {"history.txt", "history.html", "gpubench.prom"} <= names
    for path in written:
        if path.name in ("cells.yaml",):
            continue  # the user's own file
        assert PASSWORD.encode() not in path.read_bytes(), path


def test_a_password_in_an_endpoint_is_in_no_output_with_the_endpoint_up(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    endpoint = server.base_url.replace("http://", f"http://bench:{PASSWORD}@")
    terminal, records = every_output(pytester, endpoint)
    calls = [r for r in records if r["type"] == "call"]
    assert calls and all(call["error"] is None for call in calls)  # the endpoint was used
    (cell,) = [r for r in records if r["type"] == "cell"]
    assert "bench:[REDACTED]@" in str(cell["endpoint"])
    assert_nowhere(pytester, terminal)


def test_a_password_in_an_endpoint_is_in_no_output_with_the_endpoint_down(
    pytester: pytest.Pytester,
) -> None:
    terminal, records = every_output(pytester, f"http://bench:{PASSWORD}@127.0.0.1:9")
    assert "health check failed" in terminal  # the health-check line, which names the endpoint
    assert any("bench:[REDACTED]@" in str(record) for record in records)
    assert_nowhere(pytester, terminal)
