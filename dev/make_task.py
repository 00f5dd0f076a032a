"""Write the data of instruct_goose's built-in task: continue a movie-review opening positively.

Everything is made from fixed templates with a seeded `random.Random`, so the files are the same
on every run. Run from the repository root:

    python dev/make_task.py

It writes, into instruct_goose/task_data/ (JSON Lines, one object per line):

- sft.jsonl: {"prompt", "completion"}, completions one third positive, one third neutral, one third negative;
- preferences.jsonl: {"prompt", "chosen", "rejected", "split"}, chosen more positive than rejected;
- prompts.jsonl: {"prompt", "split"}, review openings for PPO, no eval opening among the train ones;
- pretrain.jsonl: {"text", "split"}, whole one- or two-sentence reviews.

Eval rows never repeat a train row of the same file.
"""
import json
import random
import re
from pathlib import Path
from string import Formatter

OUT = Path(__file__).resolve().parents[1] / "instruct_goose" / "task_data"
SEED = 0
# Row counts: as many as keep task_data/ under 400 KB.
N_SFT = 1200
N_PREFERENCES = {"train": 800, "eval": 200}
N_PROMPTS = {"train": 512, "eval": 64}
N_PRETRAIN = {"train": 450, "eval": 100}
TWO_SENTENCES = 0.3  # share of pretraining texts that get a second sentence

# Words that fill the `{slot}`s of the templates below; `{pos2}` draws from `pos` too, but never repeats `{pos}`.
SLOTS = {
    "genre": ["movie", "film", "drama", "western", "musical", "cartoon", "sequel", "documentary",
              "mystery", "remake", "picture", "feature", "biopic", "epic"],
    "aspect": ["acting", "story", "plot", "music", "ending", "dialogue", "cast", "script", "soundtrack",
               "pace", "editing", "lighting", "camera", "finale"],
    "size": ["new", "old", "long", "short", "first", "second", "latest"],
    "day": ["monday", "tuesday", "friday", "saturday", "sunday"],
    "num": ["two", "three"],
    "person": ["young woman", "old man", "farmer", "teacher", "boy", "girl", "doctor", "singer", "detective"],
    "place": ["the city", "a small town", "the coast", "the south", "the north"],
    "pos": ["great", "lovely", "charming", "delightful", "brilliant", "beautiful", "excellent", "amazing",
            "fantastic", "wonderful", "perfect", "superb", "fun", "pleasant", "enjoyable", "clever", "sweet"],
    "neg": ["bad", "awful", "terrible", "horrible", "dreadful", "ugly", "stupid", "poor", "weak", "painful",
            "dull", "boring", "annoying", "lame", "messy", "sad", "lousy"],
}

OPENINGS = [
    "The {genre}", "This {genre}", "This {size} {genre}", "The {aspect} in this {genre}",
    "The {aspect} of the {size} {genre}", "The {genre} I saw last night", "The {genre} we saw on {day}",
]

COMPLETIONS = {
    "positive": [
        " was {pos} from start to finish.", " was {pos} and {pos2} all the way through.", " was a {pos} surprise for me.",
        " made me smile and laugh the whole time.", " was the best I have seen this year.", " was so {pos} that I saw it twice.",
        " felt {pos} and I loved every minute.", " is a {pos} treat for the whole family.",
        " left me happy and glad I came.", " had me laughing and happy from the first scene to the last.",
    ],
    "neutral": [
        " was about {num} hours long.", " was shown in a small theater on {day}.",
        " was about a {person} who moves to {place}.", " was made by a young director from {place}.",
        " was shot in black and white.", " had some {pos} parts and some {neg} parts.",
        " was okay and a bit long.", " was not good and not bad.", " was what I expected and nothing more.",
        " is a {genre} about a {person} and a dog.",
    ],
    "negative": [
        " was {neg} from start to finish.", " was {neg} and {neg2} all the way through.", " was a {neg} mess for me.",
        " made me sad and bored the whole time.", " was the worst I have seen this year.",
        " was so {neg} that I hated it.", " felt {neg} and I regret every minute.",
        " is a {neg} waste of time for the whole family.", " left me tired and sorry I came.",
        " had me bored and tired from the first scene to the last.",
    ],
}

# Which sentiments a preference pair takes for chosen and rejected, used in turn.
PAIR_KINDS = [("positive", "neutral"), ("neutral", "negative"), ("positive", "negative")]


def fill(template: str, rng: random.Random) -> str:
    "Fill every `{slot}` of `template` with a word from `SLOTS`, then fix `a` before a vowel to `an`."
    values = {}
    for _, name, _, _ in Formatter().parse(template):
        if name:
            values[name] = rng.choice([w for w in SLOTS[name.rstrip("2")] if w not in values.values()])
    return re.sub(r"\ba ([aeiou])", r"an \1", template.format(**values))


def opening(rng: random.Random) -> str:
    return "Review: " + fill(rng.choice(OPENINGS), rng)


def completion(sentiment: str, rng: random.Random) -> str:
    return fill(rng.choice(COMPLETIONS[sentiment]), rng)


def distinct(n: int, make, rng: random.Random, exclude=()) -> list:
    "`n` different results of `make(rng, i)`, none of them in `exclude`."
    seen, rows = {json.dumps(r, sort_keys=True) for r in exclude}, []
    while len(rows) < n:
        row = make(rng, len(rows))
        key = json.dumps(row, sort_keys=True)
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


def sft_row(rng: random.Random, i: int) -> dict:
    return {"prompt": opening(rng), "completion": completion(list(COMPLETIONS)[i % 3], rng)}


def preference_row(rng: random.Random, i: int) -> dict:
    chosen, rejected = PAIR_KINDS[i % 3]
    return {"prompt": opening(rng), "chosen": completion(chosen, rng), "rejected": completion(rejected, rng)}


def prompt_row(rng: random.Random, i: int) -> dict:
    return {"prompt": opening(rng)}


def pretrain_row(rng: random.Random, i: int) -> dict:
    text = opening(rng) + completion(rng.choice(list(COMPLETIONS)), rng)
    if rng.random() < TWO_SENTENCES:
        second = fill(rng.choice(["The {aspect}", "The {genre}"]), rng)
        text += " " + second + completion(rng.choice(list(COMPLETIONS)), rng)
    return {"text": text}


def split_rows(counts: dict, make, rng: random.Random) -> list[dict]:
    "Train rows, then eval rows that repeat none of them, each tagged with its split."
    train = distinct(counts["train"], make, rng)
    evals = distinct(counts["eval"], make, rng, exclude=train)
    return [{**r, "split": "train"} for r in train] + [{**r, "split": "eval"} for r in evals]


def shuffled(rows: list, rng: random.Random) -> list:
    rng.shuffle(rows)
    return rows


def write_jsonl(path: Path, rows: list[dict]):
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows), encoding="utf-8")


def main():
    rng = random.Random(SEED)
    OUT.mkdir(parents=True, exist_ok=True)
    write_jsonl(OUT / "sft.jsonl", shuffled(distinct(N_SFT, sft_row, rng), rng))
    write_jsonl(OUT / "preferences.jsonl", split_rows(N_PREFERENCES, preference_row, rng))
    write_jsonl(OUT / "prompts.jsonl", split_rows(N_PROMPTS, prompt_row, rng))
    write_jsonl(OUT / "pretrain.jsonl", split_rows(N_PRETRAIN, pretrain_row, rng))


if __name__ == "__main__":
    main()
