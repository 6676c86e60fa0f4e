"""llama.cpp's n-gram drafting exactly, at the vendored commit 0c1e57098 (common/ngram-map.cpp,
ngram-mod.cpp, ngram-cache.cpp, speculative.cpp): ngram-simple, and ngram-map-k, ngram-map-k4v,
ngram-mod and ngram-cache, whose state lasts across a server's requests (_ServerState).

ngram-simple (common_ngram_simple_draft): the context's last size_n tokens are looked up, most
recent match first, skipping position 0 and the window that ends one token before the context
does; the draft is what followed the match, at most size_m tokens, none at all when fewer than
size_n tokens followed it or when the context holds size_n + size_m + 2 tokens or fewer.
The tool then cuts it to the step's limit (common_speculative_draft, common/speculative.cpp:
llama-server drafts nothing at a limit of 0, llama-speculative-simple takes a limit of 0 as none).

Under llama-speculative-simple (examples/speculative-simple) every step drafts, and
common_speculative_accept reaches the type that drafted last after every step, an empty draft's
too; each type's draft call first forgets its last draft (map: last_draft_created, mod:
n_draft_last), so that accept changes nothing, and the types are told what was accepted exactly
as llama-server tells them (keep after a non-empty draft). The tool runs one prompt per process:
its state begins afresh on each (Lookup.kept_across_prompts)."""

from __future__ import annotations

from typing import Optional, Sequence

from crossrt.errors import SettingsError
from crossrt.speculative.acceptance import Proposal
from crossrt.speculative.lookup.base import LookupDrafter


class LlamaNgramSimple(LookupDrafter):
    """size_n its --spec-ngram-simple-size-n, size_m its --spec-ngram-simple-size-m (crossrt's
    llama-server runs pass k)."""

    def __init__(self, size_n: int, size_m: int):
        super().__init__()
        self.size_n, self.size_m = size_n, size_m

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        self.calls += 1
        # llama-server's slot tokens and the token it sampled last, which the lookup names apart.
        tokens, n, m = list(context[:-1]), self.size_n, self.size_m
        if n_max < 1 or len(tokens) <= n + m + 1:
            return Proposal.chain(())
        pattern = [*tokens[len(tokens) - n + 1:], context[-1]]
        for start in range(len(tokens) - n - 1, 0, -1):
            if tokens[start:start + n] == pattern:
                copied = min(m, len(tokens) - (start + n))
                return Proposal.chain(tokens[start + n:start + n + copied][:n_max] if copied >= n else ())
        return Proposal.chain(())


class _ServerState(LookupDrafter):
    """A proposer whose state lasts as long as the tool's process: begun on each prompt (prefill,
    as common_speculative_begin on the prompt the schedule prefills), told how many draft tokens
    each verified step accepted (keep, as common_speculative_accept: only after a non-empty draft),
    and kept from one prompt to the next under llama-server, which keeps it across requests
    (Lookup.kept_across_prompts); llama-speculative-simple's process ends with its prompt."""

    def __init__(self):
        super().__init__()
        self._proposed_at = None  # the context's length at the last non-empty proposal, until kept

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        self._proposed_at = None
        if n_max < 1:  # llama-server drafts nothing at a limit of 0: no call, no state touched
            return Proposal.chain(())
        self.calls += 1
        draft = self._draft(list(context[:-1]), context[-1])[:n_max]  # the server's cut to its limit
        if draft:
            self._proposed_at = len(context)
        return Proposal.chain(draft)

    def prefill(self, ids: Sequence[int]) -> None:
        self.calls = 0  # one prompt's lookups, though the state outlives it
        self._proposed_at = None
        self._begin(list(ids))

    def keep(self, n_keep: int) -> None:
        if self._proposed_at is not None:
            self._accept(n_keep - self._proposed_at)  # the target kept the context, the accepted and the bonus
            self._proposed_at = None

    def _begin(self, prompt: list[int]) -> None:
        raise NotImplementedError

    def _draft(self, tokens: list[int], sampled: int) -> list[int]:
        raise NotImplementedError

    def _accept(self, n_accepted: int) -> None:
        raise NotImplementedError


MAP_HASH_BITS = 18  # COMMON_NGRAM_HASH_MAP_SIZE 262144 entries, indexed by an LCG hash modulo it
LCG_FACTOR = 2654435761
MAX_VALUES = 4  # COMMON_NGRAM_MAX_VALUES
MAX_COUNT = 16380  # COMMON_NGRAM_MAX_VALUE_COUNT


def _map_hash(tokens: Sequence[int], start: int, n: int) -> int:
    """common_ngram_map_hash modulo the map's size: a uint32 LCG, of which only the low bits count."""
    mask, value = (1 << MAP_HASH_BITS) - 1, 0
    for token in tokens[start:start + n]:
        value = (value * LCG_FACTOR + token) & mask
    return value


class _Key:
    """common_ngram_map_key: where the n-gram was first seen, up to where its values are counted,
    its hits, and up to four m-grams after it as [value_idx, value_num, n_accepted] (index 0: unused)."""

    __slots__ = ("key_idx", "stat_idx", "key_num", "values")

    def __init__(self, key_idx: int, m: int):
        self.key_idx, self.stat_idx, self.key_num = key_idx, 0, 0
        self.values = [[0, 0, m] for _ in range(MAX_VALUES)]


class LlamaNgramMap(_ServerState):
    """ngram-map-k (key_only) and ngram-map-k4v: common_ngram_map_begin/_draft/_accept.

    The key is the last size_n tokens, looked up through a hash of earlier n-gram positions
    (first position kept per hash; a collision found by comparing) or else by scanning back from
    size_n + size_m + 1 tokens before the end, the prompt's part first; the draft is the size_m
    tokens after the match, cut to what the key's value last had accepted. k4v also counts which
    m-grams followed the key and drafts only when the commonest is at least twice the others
    together and the key has min_hits hits. Maps, hashes and counts stay from one request to the
    next; begin trims them only when the new prompt is shorter than the text last seen."""

    def __init__(self, size_n: int, size_m: int, key_only: bool, min_hits: int = 1):
        super().__init__()
        self.n, self.m, self.key_only, self.min_hits = size_n, size_m, key_only, min_hits
        self.keys: list[_Key] = []
        self.key_map: dict[int, int] = {}  # hash -> n-gram position; absent: 0
        self.size_last_begin = self.idx_last_check = self.key_map_last_idx = 0
        self.last_draft: Optional[tuple[int, int]] = None  # (key offset, value slot) of the last draft made

    def _begin(self, prompt: list[int]) -> None:
        n, m, size_begin = self.n, self.m, len(prompt)
        cleanup = self.size_last_begin
        if cleanup > size_begin:
            cleanup = size_begin - n - m if size_begin > n + m else 0
        if size_begin < self.idx_last_check:
            self.key_map = {h: i for h, i in self.key_map.items() if i < cleanup}
            self.key_map_last_idx = cleanup - 1 if cleanup > 0 else 0
            for i in range(len(self.keys) - 1, -1, -1):
                key = self.keys[i]
                if key.key_idx >= cleanup:
                    del self.keys[i]
                    continue
                if self.key_only:
                    continue
                values = key.values
                for j in range(MAX_VALUES - 1, -1, -1):
                    if values[j][0] != 0 and values[j][0] >= cleanup:
                        for k in range(j, MAX_VALUES - 1):
                            values[k] = list(values[k + 1])
                        values[-1][0] = values[-1][1] = 0  # its n_accepted stays, as in C++
                if values[0][0] == 0:
                    del self.keys[i]
        self.idx_last_check = self.size_last_begin = size_begin

    def _draft(self, inp: list[int], sampled: int) -> list[int]:
        self.last_draft = None
        n, m, cur_len = self.n, self.m, len(inp)
        if cur_len < 2 * n + m:
            return []
        self.idx_last_check = cur_len
        key = [*inp[cur_len - n + 1:], sampled]
        newest = cur_len - n - m - 1  # the last position a key may match at
        match_pos = 0
        idx_key = self.key_map.get(_map_hash(key, 0, n), 0)
        if idx_key != 0 and idx_key < newest and inp[idx_key:idx_key + n] == key:
            match_pos = idx_key
        prompt_end = self.size_last_begin - n - m - 1
        if match_pos == 0 and self.size_last_begin > n + m + 1:
            match_pos = self._scan(inp, key, prompt_end, self.key_map_last_idx)
        if match_pos == 0:
            match_pos = self._scan(inp, key, newest, max(self.size_last_begin, self.key_map_last_idx))
        # Positions hashed in the same order as scanned; a hash keeps the first position stored.
        if self.size_last_begin > n + m + 1:
            self._hash(inp, prompt_end, self.key_map_last_idx)
        self._hash(inp, newest, max(self.size_last_begin, self.key_map_last_idx))
        self.key_map_last_idx = max(newest, self.key_map_last_idx)
        if match_pos == 0:
            return []
        offset = next((i for i, known in enumerate(self.keys) if inp[known.key_idx:known.key_idx + n] == key),
                      len(self.keys))
        if offset == len(self.keys):
            self.keys.append(_Key(match_pos, m))
        current = self.keys[offset]
        current.key_num = min(current.key_num + 1, MAX_COUNT)
        if self.key_only:
            slot = 0
        else:
            if current.key_num < self.min_hits:
                return []
            slot = self._count_values(inp, key, current, match_pos)
            if slot is None:
                return []
        self.last_draft = (offset, slot)
        # What follows this match, whichever value was counted (as common_ngram_map_draft copies).
        return inp[match_pos + n:match_pos + n + max(0, min(m, current.values[slot][2]))]

    def _count_values(self, inp: list[int], key: list[int], current: _Key, match_pos: int) -> Optional[int]:
        """k4v: count the m-grams after each occurrence of the key since the last count; the
        commonest value's slot, or None when it is not at least twice the others together."""
        n, m, values = self.n, self.m, current.values
        for i in range(current.stat_idx, match_pos + 1):
            if inp[i:i + n] != key:
                continue
            begin = i + n
            for slot, value in enumerate(values):
                if value[0] == 0:
                    values[slot] = value = [begin, 0, m]
                elif inp[begin:begin + m] != inp[value[0]:value[0] + m]:
                    continue
                value[1] = min(value[1] + 1, MAX_COUNT)
                break
        current.stat_idx = match_pos
        best = 0
        for slot in range(1, MAX_VALUES):
            if values[slot][1] > values[best][1]:
                best = slot
        others = sum(value[1] for slot, value in enumerate(values) if slot != best)
        return None if others > 0 and values[best][1] < 2 * others else best

    def _scan(self, inp: list[int], key: list[int], start: int, floor: int) -> int:
        """The latest position from start down to just above floor where the key stands; 0: none."""
        n = self.n
        for j in range(start, floor, -1):
            if inp[j:j + n] == key:
                return j
        return 0

    def _hash(self, inp: list[int], start: int, floor: int) -> None:
        for j in range(start, floor, -1):
            self.key_map.setdefault(_map_hash(inp, j, self.n), j)

    def _accept(self, n_accepted: int) -> None:
        if self.last_draft is not None:
            offset, slot = self.last_draft
            self.keys[offset].values[slot][2] = n_accepted


MOD_HASH_BITS = 22  # common_ngram_mod's 4 Mi entries, indexed by a 64-bit LCG hash modulo them
MOD_FACTOR = 6364136223846793005
MOD_FULL = 0.25  # begin empties the pool past this occupancy
MOD_CHUNK = 32  # new n-grams are added once more than this many tokens came since
MOD_LOW, MOD_LOW_STREAK = 0.25, 5  # five drafts in a row under a quarter accepted empty the pool


class LlamaNgramMod(_ServerState):
    """ngram-mod: common_ngram_mod and common_speculative_impl_ngram_mod.

    A pool of 4 Mi slots maps a hash of every n_match-gram of the text to the token after it (the
    last written wins; collisions are not checked). A draft chains lookups from the last n_match
    tokens, each drafted token extending the window, up to n_max tokens; a chain that breaks
    before n_min tokens drafts nothing. The pool is shared by all requests of one server."""

    def __init__(self, n_match: int, n_max: int, n_min: int):
        super().__init__()
        self.n, self.n_max, self.n_min = n_match, n_max, n_min
        self.pool: dict[int, int] = {}  # slot -> token; absent: EMPTY
        self.i_last = self.n_draft_last = self.n_low = 0

    def _slot(self, tokens: Sequence[int], start: int) -> int:
        mask, value = (1 << MOD_HASH_BITS) - 1, 0
        for token in tokens[start:start + self.n]:
            value = (value * MOD_FACTOR + token) & mask
        return value

    def _add(self, tokens: Sequence[int], start: int) -> None:
        self.pool[self._slot(tokens, start)] = tokens[start + self.n]

    def _begin(self, prompt: list[int]) -> None:
        self.i_last = self.n_draft_last = 0
        if len(prompt) < self.n:
            return
        for i in range(len(prompt) - self.n):
            self._add(prompt, i)
        self.i_last = len(prompt) - self.n
        if len(self.pool) / (1 << MOD_HASH_BITS) > MOD_FULL:
            self.pool.clear()

    def _draft(self, prompt: list[int], sampled: int) -> list[int]:
        self.n_draft_last = 0
        n, cur_len = self.n, len(prompt)
        if cur_len < n:
            return []
        if self.i_last + MOD_CHUNK < cur_len:
            for i in range(self.i_last, cur_len - n):
                self._add(prompt, i)
            self.i_last = cur_len - n
        window = [*prompt[cur_len - n + 1:], sampled]
        for i in range(self.n_max):
            token = self.pool.get(self._slot(window, i))
            if token is None:
                if i < self.n_min:
                    return []
                break
            window.append(token)
        draft = window[n:]
        self.n_draft_last = len(draft)  # before the server cuts it to its limit
        return draft

    def _accept(self, n_accepted: int) -> None:
        if self.n_draft_last > 0:
            if n_accepted / self.n_draft_last < MOD_LOW:
                self.n_low += 1
                if self.n_low >= MOD_LOW_STREAK:
                    self.pool.clear()
                    self.n_low = self.i_last = 0
            else:
                self.n_low = 0


# ngram-cache's fixed sizes (common/ngram-cache.h, common/speculative.cpp): crossrt runs it only
# where its own settings say the same, k 8 and ngram_max 4.
CACHE_DRAFT, CACHE_NGRAM_MAX, CACHE_STATIC = 8, 4, 2
# try_draft's lax thresholds for the context cache, by n-gram size 1 to 4 (common/ngram-cache.cpp).
CACHE_MIN_SAMPLES, CACHE_MIN_PERCENT = (2, 2, 1, 1), (66, 50, 50, 50)


def check_ngram_cache(k: int, ngram_max: int) -> None:
    if (k, ngram_max) != (CACHE_DRAFT, CACHE_NGRAM_MAX):
        raise SettingsError(f"llama.cpp's ngram-cache drafts up to {CACHE_DRAFT} tokens from 1- to "
                            f"{CACHE_NGRAM_MAX}-grams, fixed: run it at --k {CACHE_DRAFT} --ngram-max {CACHE_NGRAM_MAX}, "
                            f"not k {k}, ngram_max {ngram_max}")


class LlamaNgramCache(_ServerState):
    """ngram-cache without cache files: common_speculative_impl_ngram_cache::draft_one,
    common_ngram_cache_update and common_ngram_cache_draft.

    Each call counts, for every 1- to 4-gram, the tokens that followed it, but only within the
    tokens new since the last call (n-grams across that boundary are never counted). A draft
    token is the commonest follower of the longest suffix, 4 tokens down to 1, whose counts pass
    that size's thresholds; drafted tokens extend the suffix, up to 8. Counts and the size counted
    up to last from one request to the next. Among equally common followers llama.cpp takes the
    first in its std::unordered_map's order; a tie passes the thresholds only between exactly two
    followers, which libstdc++ holds newest first (each goes to the front), so the newer wins."""

    def __init__(self, k: int, ngram_max: int):
        check_ngram_cache(k, ngram_max)
        super().__init__()
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}  # n-gram -> follower -> count, oldest first
        self.cache_size = 0

    def _begin(self, prompt: list[int]) -> None:
        """Nothing: llama.cpp's begin is a no-op for ngram-cache."""

    def _draft(self, prompt: list[int], sampled: int) -> list[int]:
        if self.cache_size < len(prompt) + 1:
            new = [*prompt[self.cache_size:], sampled]
            for size in range(1, CACHE_NGRAM_MAX + 1):
                for i in range(size, len(new)):
                    followers = self.counts.setdefault(tuple(new[i - size:i]), {})
                    followers[new[i]] = followers.get(new[i], 0) + 1
            self.cache_size = len(prompt) + 1
        text = [*prompt, sampled]
        if len(text) < CACHE_STATIC:
            return []
        draft: list[int] = []
        while len(draft) < CACHE_DRAFT:
            token = self._next(text + draft)
            if token is None:
                break
            draft.append(token)
        return draft

    def _next(self, text: list[int]) -> Optional[int]:
        for size in range(CACHE_NGRAM_MAX, 0, -1):
            followers = self.counts.get(tuple(text[len(text) - size:]))
            if followers is None:
                continue
            best, total = max(reversed(followers.items()), key=lambda item: item[1]), sum(followers.values())
            if total >= CACHE_MIN_SAMPLES[size - 1] and 100 * best[1] >= CACHE_MIN_PERCENT[size - 1] * total:
                return best[0]
        return None

    def _accept(self, n_accepted: int) -> None:
        """Nothing: ngram-cache learns from the text only."""
