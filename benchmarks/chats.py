"""Realistic chat traffic for `vllm bench serve --dataset-name sharegpt`: real text, multi-turn, mixed prompt and
answer lengths. Each conversation's first turn is the whole earlier dialogue as one user message (a question, an
answer quoted from the project's public-domain corpus, a follow-up question, ...), its second turn an answer whose
token count sets the request's max_tokens (32-320). Seeded, so every engine gets the same requests.

    python benchmarks/chats.py OUT.json [--n 200] [--seed 0]
"""

import argparse
import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tokenmill" / "bench" / "data"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    questions = json.loads((DATA / "chats.json").read_text())
    words = (DATA / "quality_corpus.txt").read_text().split()

    def passage(n_words: int) -> str:
        start = rng.randrange(0, len(words) - n_words)
        return " ".join(words[start:start + n_words])

    conversations = []
    for i in range(a.n):
        turns = rng.choice([1, 1, 2, 3, 4])
        lines = []
        for t in range(turns):
            lines.append(f"User: {rng.choice(questions)}")
            if t < turns - 1:
                lines.append(f"Assistant: {passage(rng.randint(20, 220))}")
        lines.append(f"User: {rng.choice(questions)} Please also quote: {passage(rng.randint(5, 60))}")
        answer = passage(rng.randint(24, 240))   # ~1.3 tokens a word: 32-320 output tokens
        conversations.append({"id": f"chat-{i}", "conversations": [
            {"from": "human", "value": "\n".join(lines)}, {"from": "gpt", "value": answer}]})
    Path(a.out).write_text(json.dumps(conversations, indent=1))


if __name__ == "__main__":
    main()
