"""Stored responses of OpenAI's Responses API (`store`, true by default): each kept with its own turn's
input items and output items and the id of the response it continued, so that

    previous_response_id     continues a conversation the client does not send again (the stored
                             turns' items, oldest first, then the new input; instructions are not
                             carried over, as OpenAI's are not)
    GET /v1/responses/{id}   reads one back, /input_items the items it answered, DELETE forgets it

With API keys, a stored response is its key's: another key's requests (continue, read, delete,
cancel) find nothing there. Kept in this router's memory: the least recently stored go first past
--max-stored-responses (0 keeps none), and a router does not see another's (route a conversation to
one router, or send its items).
A turn whose stored ancestor is gone cannot be continued: a 404 says which."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from common.sampling import InvalidField
from router.core import CLIENT
from router.gateway.http_body import error


class ResponseNotFound(LookupError):
    def __init__(self, response_id: str, why: str = "") -> None:
        super().__init__(f"no stored response {response_id!r}{why} in this router (responses are kept by the "
                         f"router that answered them)")
        self.response_id = response_id


@dataclass(frozen=True)
class Stored:
    response: dict  # the response object as it was answered
    inputs: list[dict]  # this turn's input items
    previous: str | None  # the response it continued
    owner: bytes  # the API key's digest that stored it (b"": keys are off); no other key finds it


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response: dict, inputs: list[dict], previous: str | None, owner: bytes = b"") -> None:
        if self.capacity <= 0:
            return
        self._kept[response["id"]] = Stored(response, inputs, previous, owner)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> dict:
        return self._stored(response_id).response

    def delete(self, response_id: str) -> None:
        self._stored(response_id)
        del self._kept[response_id]

    def history(self, response_id: str) -> list[dict]:
        """The items of the conversation up to and including the response: each turn's input items,
        then its output items, oldest turn first."""
        if self.capacity <= 0:
            raise ResponseNotFound(response_id, " (this router stores none: --max-stored-responses 0)")
        turns: list[Stored] = []
        at: str | None = response_id
        while at is not None:
            try:
                turns.append(self._stored(at))
            except ResponseNotFound:
                why = "" if at == response_id else f" (it continues {at!r}, which is no longer stored)"
                raise ResponseNotFound(response_id, why) from None
            if turns[-1].response.get("status") in ("queued", "in_progress"):
                raise InvalidField("previous_response_id", f"{at!r} is still in progress: wait until it is done")
            at = turns[-1].previous
        return [item for turn in reversed(turns) for item in (*turn.inputs, *turn.response["output"])]

    def input_items(self, response_id: str) -> list[dict]:
        """What the response answered: the conversation before it, then its own input items."""
        stored = self._stored(response_id)
        return (self.history(stored.previous) if stored.previous else []) + stored.inputs

    def _stored(self, response_id: str) -> Stored:
        """Another key's response is not found either: the same answer, so nothing tells them apart."""
        stored = self._kept.get(response_id)
        if stored is None or stored.owner != CLIENT.get():
            raise ResponseNotFound(response_id)
        return stored


def add_stored_response_routes(app: FastAPI, store: ResponseStore) -> None:
    """GET /v1/responses/{id}/input_items and DELETE /v1/responses/{id} (GET /v1/responses/{id} itself:
    router.gateway.background, which also follows a response as it runs)."""

    def not_found(err: ResponseNotFound) -> JSONResponse:
        return error(404, str(err), "response_id", "not_found_error")

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str) -> JSONResponse:
        try:
            items = store.input_items(response_id)
        except ResponseNotFound as err:
            return not_found(err)
        ids = [item.get("id") for item in items]
        return JSONResponse({"object": "list", "data": items, "first_id": ids[0] if ids else None,
                             "last_id": ids[-1] if ids else None, "has_more": False})

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        try:
            store.delete(response_id)
        except ResponseNotFound as err:
            return not_found(err)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
