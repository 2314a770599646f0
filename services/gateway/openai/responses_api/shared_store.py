"""The Responses API's store shared by one gateway's API servers (`--api-server-count`)
when the gateway has no kv-cache-manager (whose Redis store every replica shares,
store.py): the same bounded LRU as the in-memory store, in one SQLite file every
process opens.

Invariants: at most `capacity` rows, the least recently used (stored or read) dropped
first; a response stored by one process is found by every other from the moment its
`put` returns (each statement commits; WAL lets readers run beside the writer). Rows
are small JSON (a response and its conversation); each call is one short local
transaction, cheap beside the generation that produced the response.
"""

from __future__ import annotations

import json
import sqlite3
import time

from pagoda.services.gateway.openai.responses_api.store import MemoryResponseStore, StoredResponse


class FileResponseStore(MemoryResponseStore):
    def __init__(self, path: str, capacity: int) -> None:
        super().__init__(capacity)
        # One connection per process, used from its event loop thread only.
        self._db = sqlite3.connect(path, timeout=10.0, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, "
                         "used REAL NOT NULL, item TEXT NOT NULL)")
        self._db.execute("CREATE INDEX IF NOT EXISTS responses_used ON responses (used)")

    async def put(self, response_id: str, item: StoredResponse) -> None:
        if not self.enabled:
            return
        text = json.dumps({"response": item.response, "messages": item.messages})
        with self._db:  # one transaction: insert, then trim to capacity
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?)",
                             (response_id, time.time(), text))
            self._db.execute("DELETE FROM responses WHERE id NOT IN (SELECT id FROM "
                             "responses ORDER BY used DESC LIMIT ?)", (self.capacity,))

    async def get(self, response_id: str) -> StoredResponse | None:
        row = self._db.execute("SELECT item FROM responses WHERE id = ?",
                               (response_id,)).fetchone()
        if row is None:
            return None
        self._db.execute("UPDATE responses SET used = ? WHERE id = ?", (time.time(), response_id))
        data = json.loads(row[0])
        return StoredResponse(data["response"], data["messages"])

    async def delete(self, response_id: str) -> bool:
        return self._db.execute("DELETE FROM responses WHERE id = ?",
                                (response_id,)).rowcount > 0

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]
