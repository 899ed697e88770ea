"""Reference solution for `survey_top_words`; run with the workspace as the current directory."""

import json
import re
from collections import Counter
from pathlib import Path

stop = set(Path("stopwords.txt").read_text().split())
words = [
    w for w in re.findall(r"[a-z]+", Path("responses.txt").read_text().lower()) if w not in stop
]
top = sorted(Counter(words).items(), key=lambda kv: (-kv[1], kv[0]))[:5]
Path("top_words.json").write_text(json.dumps([[w, c] for w, c in top]))
