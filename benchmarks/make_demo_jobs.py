"""Regenerate ``src/retrysafe/demo/jobs.jsonl``: 1,000 realistic post-publishing jobs.

Deterministic (seeded), so the bundled file only changes when this script does.

    python benchmarks/make_demo_jobs.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "src" / "retrysafe" / "demo" / "jobs.jsonl"

SHOPS = [
    "lumen-ceramics",
    "northwind-coffee",
    "atelier-mira",
    "kofi-bikes",
    "hana-tea",
    "blue-fern-books",
    "oaken-goods",
    "salt-and-sail",
    "pixel-paper",
    "verde-plants",
]
CHANNELS = ["instagram", "facebook", "x", "linkedin", "threads", "mastodon"]
OPENERS = [
    "Just in:",
    "Back in stock!",
    "Weekend deal:",
    "New drop",
    "Behind the scenes:",
    "Customer story:",
    "Last chance:",
    "Meet the maker:",
    "Fresh from the studio:",
]
PRODUCTS = [
    "hand-thrown mugs",
    "single-origin beans",
    "linen aprons",
    "gravel tyres",
    "first-flush sencha",
    "signed first editions",
    "oak serving boards",
    "waxed canvas totes",
    "risograph prints",
    "monstera cuttings",
]
DETAILS = [
    "Small batch, ships in 48 h.",
    "Free shipping over 40 EUR.",
    "Only 12 left.",
    "Made 20 km from our shop.",
    "Gift wrapping included.",
    "Pre-orders open until Sunday.",
    "Each piece is one of a kind.",
    "Now with a recycled-paper box.",
    "Tag us when yours arrives!",
]
TAGS = [
    "#handmade",
    "#smallbusiness",
    "#shoplocal",
    "#slowliving",
    "#newin",
    "#giftideas",
    "#sustainable",
    "#craft",
    "#design",
    "#weekendvibes",
]
LANGS = {
    "en": "",
    "de": " Jetzt im Shop.",
    "fr": " Disponible en boutique.",
    "ja": " オンラインショップで販売中。",
    "es": " Ya en la tienda.",
}


def main() -> None:
    rng = random.Random(2026)
    lines = []
    for i in range(1, 1001):
        lang = rng.choice(list(LANGS))
        sentences = [rng.choice(OPENERS), rng.choice(PRODUCTS) + "."]
        sentences += rng.sample(DETAILS, k=rng.randint(1, 4))
        text = " ".join(sentences) + LANGS[lang]
        if rng.random() < 0.15:  # some long-form posts (several KB)
            text += " " + " ".join(rng.choice(DETAILS) for _ in range(rng.randint(20, 120)))
        media = [
            {
                "url": f"https://cdn.example.com/{rng.getrandbits(48):012x}.jpg",
                "alt": rng.choice(PRODUCTS),
            }
            for _ in range(rng.choice([0, 1, 1, 2, 4]))
        ]
        job = {
            "job_id": f"post-{i:05d}",
            "shop": rng.choice(SHOPS),
            "channel": rng.choice(CHANNELS),
            "language": lang,
            "text": text,
            "hashtags": rng.sample(TAGS, k=rng.randint(0, 5)),
            "media": media,
            "generate_caption": rng.random() < 0.3,
        }
        lines.append(json.dumps(job, ensure_ascii=False))
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} jobs to {OUT}")


if __name__ == "__main__":
    main()
