"""What a user's reaction to a served completion looks like on the wire: `POST /v1/feedback`.

    {"event_id": "e-123",            the client's id for this event: a retry sends the same one
     "completion_id": "cmpl-...",    the `id` of the served response
     "choice": 0,                    which of its choices (default 0)
     "kind": "thumbs" | "accept" | "edit",
     "value": "up"/"down" | "accept"/"reject" | "kept"/"reverted",
     "text": "optional comment"}

Answers: 200 `{"event_id", "status": "added" | "duplicate"}` (a retried event is stored and
counted once); 400 for a malformed event; 404 for a completion the log does not hold; 409 for an
`event_id` already used by a different event. The event is committed before the 200 is sent.
"""

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from strop.online.store import FeedbackRow

VALUES = {"thumbs": ("up", "down"), "accept": ("accept", "reject"), "edit": ("kept", "reverted")}
TEXT_MAX = 4000  # characters of a comment


class FeedbackEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not a silently lost rating

    event_id: str = Field(min_length=1, max_length=128)
    completion_id: str = Field(min_length=1, max_length=128)
    choice: int = Field(0, ge=0, le=15)
    kind: Literal["thumbs", "accept", "edit"]
    value: str
    text: str | None = Field(None, max_length=TEXT_MAX)

    @model_validator(mode="after")
    def _value_fits_kind(self) -> "FeedbackEvent":
        if self.value not in VALUES[self.kind]:
            raise ValueError(
                f"a {self.kind!r} event's value is one of {' / '.join(VALUES[self.kind])}, not {self.value!r}"
            )
        return self

    def row(self, key_name: str | None) -> FeedbackRow:
        return FeedbackRow(
            self.event_id, self.completion_id, self.choice, self.kind, self.value, self.text, key_name, time.time()
        )
