"""The process rlkjax.rl.rewards.MathVerifier checks answers in: run as a script, not imported.

Protocol, one JSON object per line: in {"answer": str, "completion": str}; out {"reward": 0.0 | 1.0} or
{"error": "Type: message"}. It prints {"ready": true} once math-verify is loaded and warmed up (the
first LaTeX parse builds the ANTLR parser, ~1 s), so no check is charged for the start.

math-verify's own timeouts (SIGALRM) are off here: the parent bounds each check's wall time and kills
this process past it, which also stops work a signal cannot interrupt.
"""

import json
import logging
import sys

from math_verify import parse, verify

logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warning: we bound time


def parse_answer(answer: str) -> list:
    """A data set's answer is often bare LaTeX (`\\frac{1}{2}`, `\\sqrt{2}`) that math-verify only finds
    between math delimiters: try it as written, then inside `$...$`."""
    parsed = parse(answer, parsing_timeout=None, raise_on_error=True)
    return parsed or parse(f"${answer}$", parsing_timeout=None, raise_on_error=True)


def check(answer: str, completion: str) -> float:
    gold = parse_answer(answer)
    if not gold:
        raise ValueError(f"the reference answer {answer[:200]!r} does not parse as math")
    predicted = parse(completion, parsing_timeout=None, raise_on_error=True)
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=None, raise_on_error=True))


def main() -> None:
    # Replies go to the real stdout; anything the libraries print goes to stderr, not into the protocol.
    replies, sys.stdout = sys.stdout, sys.stderr
    check("\\frac{1}{2}", "$\\boxed{0.5}$")
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"reward": check(request["answer"], request["completion"])}
        except Exception as e:  # reported to the trainer with its example, not raised there
            reply = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        print(json.dumps(reply), file=replies, flush=True)


if __name__ == "__main__":
    main()
