"""A tokenizer with one token per character (its code point): enough for the episode loop without an engine."""


class Chars:
    def decode(self, ids, **_):
        return "".join(map(chr, ids))

    def __call__(self, text, add_special_tokens=False, split_special_tokens=False):
        return type("Encoding", (), {"input_ids": [ord(c) for c in text]})()
