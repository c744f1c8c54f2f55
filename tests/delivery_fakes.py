"""Stand-ins for what a sampler's :class:`rlflow.sampler.delivery.GroupDelivery` talks to:
a tokenizer whose ids are character codes, and a ring-buffer client that keeps the records."""


class CharTokenizer:
    """``decode`` maps each id to ``chr(id)`` (no special tokens)."""

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(chr(t) for t in tokens)


class RecordingBuffer:
    """``put_groups`` keeps every record in ``records`` and reports no error."""

    def __init__(self):
        self.records = []

    def put_groups(self, records):
        self.records += records
        return {}
