"""Stop strings: finding them in a growing output text, and what is safe to stream."""

from __future__ import annotations

from typing import Sequence


class StopChecker:
    """Finds the first stop string to complete in an append-only output text.

    Invariants:
      * `check` reports a match only if it contains at least one of the newest
        `num_new_chars` characters (older matches were reported by earlier calls), and only
        searches the tail that can hold one: the new characters plus ``len(stop) - 1``
        characters before them.
      * "Earliest wins" means the match that completes first: among all matches, the one
        that ends earliest in the text (then, on a tie, the longer one). So the result does
        not depend on how the text was split into chunks - it is what a per-character
        check would find. With ``stop=["abc", "b"]`` and text ``"xabc"``, ``"b"`` wins.
      * `partial_match_len(text)` is the length of the longest suffix of `text` that is a
        proper prefix of some stop string. A streamer that holds back exactly those
        characters never emits text that a later match would remove.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            stop = [stop]
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError("stop must be a list of non-empty strings.")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        # Characters a held-back suffix can end in: a proper prefix of a stop string ends
        # in one of its characters but the last. Most text's last character is none of
        # them, which answers `partial_match_len` without a search.
        self._prefix_end_chars = frozenset(c for s in self.stop for c in s[:-1])

    def check(self, output_text: str, num_new_chars: int) -> tuple[str | None, int]:
        """Look for a stop string completed by the last `num_new_chars` characters.

        Returns ``(stop_str, length)``: the matched stop string and the length to truncate
        `output_text` to (before the match, or after it with include_stop_str_in_output);
        ``(None, len(output_text))`` when nothing matched.
        """
        text_len = len(output_text)
        if num_new_chars <= 0 or not self.stop:
            return None, text_len
        first_new = text_len - min(num_new_chars, text_len)
        best: tuple[int, int, str] | None = None  # (end, start, stop_str)
        for stop_str in self.stop:
            # A match containing a new char starts at or after this position.
            start = output_text.find(stop_str, max(0, first_new - len(stop_str) + 1))
            if start == -1:
                continue
            candidate = (start + len(stop_str), start, stop_str)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None, text_len
        end, start, stop_str = best
        return stop_str, end if self.include_stop_str_in_output else start

    def partial_match_len(self, output_text: str) -> int:
        """Length of the longest suffix of `output_text` that could still grow into a stop
        string (a proper prefix of one); 0 when none could."""
        if not output_text or output_text[-1] not in self._prefix_end_chars:
            return 0
        longest = 0
        text_len = len(output_text)
        for stop_str in self.stop:
            first_char = stop_str[0]
            # Earliest candidate first: the first hit is this stop string's longest suffix.
            pos = output_text.find(first_char, max(0, text_len - len(stop_str) + 1))
            while pos != -1 and text_len - pos > longest:
                if stop_str.startswith(output_text[pos:]):
                    longest = max(longest, text_len - pos)
                    break
                pos = output_text.find(first_char, pos + 1)
        return longest
