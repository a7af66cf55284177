"""Files the pytester-based tests write into their benchmark project."""

import struct
import zlib

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


def png(red: int) -> bytes:
    """A 2x2 PNG of one colour, an image prompt's file (zlib and struct: no imaging library)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        return struct.pack(">I", len(data)) + kind + data + crc

    rows = b"".join(b"\x00" + bytes((red, 0, 0)) * 2 for _ in range(2))
    header = struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
