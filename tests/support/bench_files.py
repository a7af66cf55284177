"""Files the pytester-based tests write into their benchmark project."""

# The benchmark test users write: measure the case, fail it when the call failed.
CHECKED_TEST_FILE = """
def test_generate(gpubench_case):
    call = gpubench_case.run()
    assert call["error"] is None, call["error"]
"""

# One short prompt: enough for tests about where cells run rather than what they measure.
ONE_PROMPT = """\
prompts:
  P-EASY: {intent: short, prompt: "What is the capital of France?", max_tokens: 8}
"""
