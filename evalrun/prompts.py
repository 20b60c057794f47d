"""Prompt sets: JSONL files of `{"id", "prompt"}` or `{"id", "messages"}` records, tokenized and hashed.

The prompt-set hash covers the records and their token ids, so a changed chat template or
tokenizer also changes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import CONFIGS_DIR, MAX_NEW_TOKENS_LIMIT
from .errors import PromptError
from .json_input import RepeatedKey, object_without_repeated_keys
from .hashing import hash_value

ALLOWED_KEYS = {"id", "prompt", "messages", "max_new_tokens"}


@dataclass
class PromptRecord:
    id: str
    prompt: str | None
    messages: list[dict[str, str]] | None
    max_new_tokens: int | None

    def as_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {"id": self.id}
        if self.prompt is not None:
            record["prompt"] = self.prompt
        if self.messages is not None:
            record["messages"] = self.messages
        if self.max_new_tokens is not None:
            record["max_new_tokens"] = self.max_new_tokens
        return record


@dataclass
class PromptSet:
    name: str
    path: str
    records: list[PromptRecord]
    token_ids: list[list[int]]

    @property
    def hash(self) -> str:
        return hash_value({"records": [r.as_dict() for r in self.records], "token_ids": self.token_ids})

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "hash": self.hash, "count": len(self.records)}


def resolve_path(name_or_path: str) -> Path:
    """'default' and 'smoke' name the shipped sets; anything else is a file path."""
    path = Path(name_or_path)
    shipped = CONFIGS_DIR / "prompts" / f"{name_or_path}.jsonl"
    if not path.suffix and shipped.exists():
        return shipped
    if not path.is_file():
        raise PromptError(f"prompt file {name_or_path} does not exist; pass a JSONL file or one of: "
                          + ", ".join(sorted(p.stem for p in (CONFIGS_DIR / "prompts").glob("*.jsonl"))))
    return path


def _parse_record(path: Path, number: int, line: str) -> PromptRecord:
    where = f"{path}:{number}"
    try:
        data = json.loads(line, object_pairs_hook=object_without_repeated_keys)
    except RepeatedKey as repeated:
        raise PromptError(f"{where}: the key {str(repeated)[:40]!r} is given twice in one object (JSON readers "
                          "keep the last or the first); keep one") from None
    except json.JSONDecodeError as error:
        raise PromptError(f"{where}: not valid JSON ({error.msg}); each line must be one JSON object") from None
    except RecursionError:
        raise PromptError(f"{where}: JSON nested too deeply; each line must be one flat JSON object") from None
    except ValueError:  # an integer of more than 4300 digits (Python's limit on converting text to int)
        raise PromptError(f"{where}: a number too long to read (over 4300 digits); max_new_tokens is an integer "
                          f"from 1 to {MAX_NEW_TOKENS_LIMIT}, fix the record") from None
    if not isinstance(data, dict):
        raise PromptError(f"{where}: expected a JSON object with 'id' and 'prompt' or 'messages'")
    unknown = set(data) - ALLOWED_KEYS
    if unknown:
        raise PromptError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(ALLOWED_KEYS)}")
    if "id" not in data or data["id"] is None:
        raise PromptError(f"{where}: missing 'id'; give every record a unique id")
    if not isinstance(data["id"], str):  # null read as "None", 1 and "1" as one id: an id is what the file says
        raise PromptError(f"{where}: the id {json.dumps(data['id'])[:40]} is a {type(data['id']).__name__}, not a "
                          f"string; write it in quotes, e.g. \"id\": \"{str(data['id'])[:20]}\"")
    if not data["id"].strip():
        raise PromptError(f"{where}: the id is blank; give every record a unique id")
    has_prompt, has_messages = isinstance(data.get("prompt"), str), isinstance(data.get("messages"), list)
    if has_prompt == has_messages:
        raise PromptError(f"{where}: give exactly one of 'prompt' (a string) or 'messages' (a list)")
    if has_messages and not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                                for m in data["messages"]):
        raise PromptError(f"{where}: every message needs 'role' and 'content' strings")
    if has_messages and not data["messages"]:
        raise PromptError(f"{where}: 'messages' is empty; give at least one message")
    texts = [data["prompt"]] if has_prompt else [m[k] for m in data["messages"] for k in ("role", "content")]
    if not all(_encodable(text) for text in texts + [data["id"]]):
        raise PromptError(f"{where}: text that is not valid Unicode (a lone surrogate escape); fix the record")
    if not data["id"].isprintable() or len(data["id"]) > 200:
        raise PromptError(f"{where}: the id {data['id'][:40]!r} holds a line break, control or bidirectional "
                          "character, or is over 200 characters; ids are names in reports: use printable text")
    limit = data.get("max_new_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                              or not 1 <= limit <= MAX_NEW_TOKENS_LIMIT):
        raise PromptError(f"{where}: max_new_tokens must be an integer from 1 to {MAX_NEW_TOKENS_LIMIT}")
    return PromptRecord(data["id"], data.get("prompt"), data.get("messages"), limit)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_records(path: Path) -> list[PromptRecord]:
    """The records of a JSONL file, read a line at a time. Lines end at "\n" only (a "\r" before it is
    dropped): U+2028, U+2029 and U+0085 are legal inside a JSON string, where str.splitlines broke them."""
    records = []
    try:
        with path.open(encoding="utf-8", newline="\n") as lines:
            for number, line in enumerate(lines, 1):
                line = line.removesuffix("\n").removesuffix("\r")
                if line.strip():
                    records.append(_parse_record(path, number, line))
    except UnicodeDecodeError:
        raise PromptError(f"{path}: not UTF-8 text; save the prompt file as UTF-8") from None
    if not records:
        raise PromptError(f"{path}: no prompts; add one JSON object per line")
    seen: set[str] = set()
    for record in records:
        if record.id in seen:
            raise PromptError(f"{path}: duplicate id {record.id!r}; ids must be unique")
        seen.add(record.id)
    return records


def encode(tokenizer: Any, record: PromptRecord) -> list[int]:
    """Token ids of a record: chat template for `messages`, plain encoding for `prompt`."""
    if record.messages is not None:
        if not tokenizer.chat_template:
            raise PromptError(f"prompt {record.id!r} uses messages but the tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(record.messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(record.prompt, add_special_tokens=True)["input_ids"]]


CHARS_A_TOKEN = 16  # the first prefix a long prompt is measured by: (positions + 2) x this many characters


def tokens_past_context(tokenizer: Any, text: str, context_limit: int) -> tuple[int, int] | None:
    """(tokens, characters) of a prefix of `text` that alone holds more tokens than `context_limit`, else None.

    A tokenizer's memory grows with its input (about 200 bytes a character: a 50 MB prompt took 10 GB before its
    length was refused), so a prompt is not tokenized whole to learn that it is too long. Prefixes four times
    longer each are tokenized until one exceeds the positions or the prefix is the whole text. A cut can split
    one token in two, so a prefix must hold two tokens more than the positions to prove the whole too long."""
    size = (context_limit + 2) * CHARS_A_TOKEN
    while size < len(text):
        count = len(tokenizer(text[:size], add_special_tokens=False)["input_ids"])
        if count > context_limit + 1:
            return count, size
        size *= 4
    return None


def load_prompt_set(name_or_path: str, tokenizer: Any, context_limit: int | None = None,
                    new_tokens: int | None = None) -> PromptSet:
    """Read, validate and tokenize a prompt set; with `context_limit`, every prompt plus its new
    tokens (its own max_new_tokens, else `new_tokens`) must fit the model's positions."""
    path = resolve_path(name_or_path)
    records = read_records(path)
    token_ids = []
    for record in records:
        try:
            text = record.prompt if record.prompt is not None else "\n".join(m["content"] for m in record.messages)
            past = tokens_past_context(tokenizer, text, context_limit) if context_limit is not None else None
            if past is not None:
                raise PromptError(f"{path}: prompt {record.id!r} has more tokens than the model's {context_limit} "
                                  f"positions ({past[0]} in its first {past[1]} characters); shorten it")
            token_ids.append(encode(tokenizer, record))
        except PromptError:
            raise
        except Exception as error:  # noqa: BLE001 - the tokenizer refused this record: bad input, not a crash
            first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            raise PromptError(f"{path}: the tokenizer cannot encode prompt {record.id!r} ({first}); fix the record") from None
    for record, ids in zip(records, token_ids):
        if not ids:
            raise PromptError(f"{path}: prompt {record.id!r} encodes to no tokens; give it some text")
        total = len(ids) + (record.max_new_tokens or new_tokens or 0)
        if context_limit is not None and total > context_limit:
            raise PromptError(f"{path}: prompt {record.id!r} has {len(ids)} tokens, with its new tokens {total}, "
                              f"past the model's {context_limit} positions; shorten it or lower --max-new-tokens")
    return PromptSet(path.stem, str(path), records, token_ids)
