"""A radix tree of token ids whose nodes own pool pages: the structure behind prefix reuse.

Each node holds an *edge*: the tokens at positions `start ... end - 1` of every sequence that
passes through it. A page holds the K/V of positions `k * page_size ... (k + 1) * page_size - 1`,
and it belongs to the node that holds the page's last position, so every page is owned by exactly
one node and a node owns `end // page_size - start // page_size` pages, in order. An edge may
start or end mid-page: two branches that diverge inside page `k` each own their own page `k`
(their first tokens are the same, the rest differ).

Only whole pages are inserted, so every leaf ends on a page boundary. That is what lets a match
end mid-page and still use the page: below any matched position there is a leaf further down,
and the page it owns for that position holds the matched tokens (the caller copies it before
writing the rest: copy-on-write).

No pool, no torch: the tree records which page holds what, and `PrefixCache` decides when pages
are held and released.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, overload

from kvctl.agent.pool.errors import InvariantViolated

_T = TypeVar("_T")
_CHUNK = 64  # tokens compared per slice when looking for where two sequences diverge


def common_prefix_len(
    tokens: Sequence[int], offset: int, edge: Sequence[int], end: int | None = None
) -> int:
    """How many tokens of `edge` equal `tokens[offset:end]`, position by position.

    Compares whole slices first (a C loop), then chunks, then single tokens, so a long edge costs
    a handful of Python operations rather than one per token.
    """
    n = min(len(edge), (len(tokens) if end is None else min(end, len(tokens))) - offset)
    if n == len(edge):
        if tokens[offset : offset + n] == edge:
            return n
    elif tokens[offset : offset + n] == edge[:n]:
        return n
    i = 0
    while i + _CHUNK <= n and tokens[offset + i : offset + i + _CHUNK] == edge[i : i + _CHUNK]:
        i += _CHUNK
    while i < n and tokens[offset + i] == edge[i]:
        i += 1
    return i


@dataclass(eq=False, slots=True)
class RadixNode:
    """One edge of the tree: its tokens, the pages it owns and what eviction policies read.

    `created`, `last_access` and `hits` are ticks of the owning cache's logical clock and a use
    count, kept whatever the policy, so the policy can change at run time. `queued` says whether
    the node has its (single) entry in the cache's eviction order.
    """

    node_id: int
    start: int
    tokens: list[int]
    pages: list[int]
    parent: RadixNode | None
    created: int = 0
    last_access: int = 0
    hits: int = 0
    children: dict[int, RadixNode] = field(default_factory=dict)
    queued: bool = False
    stored_at: float = 0.0  # clock seconds of the insert that made it (0: not timed)
    used_at: float = 0.0  # clock seconds of its last use or insert (residency figures)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_leaf(self) -> bool:
        return not self.children


def _span(pages: Sequence[int]) -> int | None:
    """The first page when `pages` are the ids `first, first + 1, ...` in order; None otherwise.

    `pages` are distinct (a page table's are), so ascending order and the right distance from
    the first to the last are enough, and `sorted` on sorted input is one C pass.
    """
    n = len(pages)
    if not n:
        return None
    first = pages[0]
    if pages[-1] - first != n - 1 or first < 0:
        return None
    if n > 2 and pages != sorted(pages):
        return None
    return first


class RadixTreeCorrupted(InvariantViolated):
    """A radix tree's guarantees do not hold (`RadixTree.check`): a bug, never a user error."""


class PageOwners(MutableMapping[int, "RadixNode"]):
    """Which node owns each tree page, shared by the partitions of one cache, brought up to date
    when it is read.

    Only page moves (defragmentation) and checks read it, while every insert, split and eviction
    changes it, and at page size 1 a node owns one page per token. So a change is only noted, per
    node (`note`: the node now owns pages it did not), and the per-page work waits for the next
    read, once per noted node (`sync`). A page that left the tree keeps its entry until it is
    read, and is then seen to be stale (its node no longer holds it). A list indexed by page id,
    so a run of consecutive pages is indexed with one slice assignment.
    """

    __slots__ = ("_compact_at", "_nodes", "_pending")

    def __init__(self, pages: int = 0) -> None:
        self._nodes: list[RadixNode | None] = [None] * pages  # grows to the highest page seen
        self._pending: list[RadixNode] = []
        self._compact_at = 1024

    def note(self, node: RadixNode) -> None:
        """`node` has pages no entry names it for yet (a new leaf, the upper half of a split)."""
        pending = self._pending
        pending.append(node)
        if len(pending) > self._compact_at:
            # nothing reads the index: forget removed nodes and repeats, per node, not per page
            live = {id(n): n for n in pending if n.parent is not None}
            pending[:] = live.values()
            self._compact_at = max(1024, 2 * len(pending))

    def sync(self) -> None:
        """Index the pages of every noted node that is still in its tree."""
        nodes = self._nodes
        for node in self._pending:
            pages = node.pages
            if node.parent is None or not pages:
                continue
            first = _span(pages)
            if first is not None:
                self._grow(first + len(pages))
                nodes[first : first + len(pages)] = [node] * len(pages)
            else:
                self._grow(max(pages) + 1)
                for page in pages:
                    nodes[page] = node
        self._pending.clear()

    @overload
    def get(self, page: int, /) -> RadixNode | None: ...

    @overload
    def get(self, page: int, default: RadixNode, /) -> RadixNode: ...

    @overload
    def get(self, page: int, default: _T, /) -> RadixNode | _T: ...

    def get(self, page: int, default: object = None, /) -> object:
        """The node that owns `page` now, or `default` (a stale entry is dropped on the way)."""
        if self._pending:
            self.sync()
        nodes = self._nodes
        node = nodes[page] if 0 <= page < len(nodes) else None
        if node is None:
            return default
        if node.parent is None or page not in node.pages:
            nodes[page] = None
            return default
        return node

    def indexed(self, page: int) -> RadixNode | None:
        """The node the entry for `page` names, unchecked (right for a page that is in a tree:
        the check that `get` adds is for pages that left it)."""
        if self._pending:
            self.sync()
        nodes = self._nodes
        return nodes[page] if 0 <= page < len(nodes) else None

    def __getitem__(self, page: int) -> RadixNode:
        node = self.get(page)
        if node is None:
            raise KeyError(page)
        return node

    def __contains__(self, page: object) -> bool:
        return isinstance(page, int) and self.get(page) is not None

    def __setitem__(self, page: int, node: RadixNode) -> None:
        if page < 0:
            raise KeyError(page)
        if self._pending:
            self.sync()
        self._grow(page + 1)
        self._nodes[page] = node

    def __delitem__(self, page: int) -> None:
        if page not in self:
            raise KeyError(page)
        self._nodes[page] = None

    def __iter__(self) -> Iterator[int]:
        if self._pending:
            self.sync()
        held: dict[int, set[int]] = {}  # node -> its pages, built once per node
        live = []
        for page, node in enumerate(self._nodes):
            if node is None or node.parent is None:
                continue
            pages = held.get(id(node))
            if pages is None:
                pages = held[id(node)] = set(node.pages)
            if page in pages:
                live.append(page)
        return iter(live)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def relocate(self, moves: dict[int, int]) -> int:
        """Rename moved pages (`{old: new}`) in their nodes; return how many were tree pages."""
        if self._pending:
            self.sync()
        nodes = self._nodes
        moved = 0
        for old, new in moves.items():
            node = nodes[old] if 0 <= old < len(nodes) else None
            if node is None:
                continue
            nodes[old] = None
            if node.parent is None or old not in node.pages:
                continue  # a stale entry: the page left the tree
            node.pages[node.pages.index(old)] = new
            self._grow(new + 1)
            nodes[new] = node
            moved += 1
        return moved

    def _grow(self, length: int) -> None:
        missing = length - len(self._nodes)
        if missing > 0:
            self._nodes.extend([None] * missing)


def relocate_pages(owners: MutableMapping[int, RadixNode], moves: dict[int, int]) -> int:
    """Rename the pages the defragmenter moved (`{old: new}`) in the nodes that own them; return
    how many tree pages moved. `owners` is the page index of the trees concerned."""
    if isinstance(owners, PageOwners):
        return owners.relocate(moves)
    moved = 0
    for old, new in moves.items():
        node = owners.pop(old, None)
        if node is not None:
            node.pages[node.pages.index(old)] = new
            owners[new] = node
            moved += 1
    return moved


@dataclass(frozen=True)
class TreeMatch:
    """The longest cached prefix of a query: `tokens` positions, in `pages` (the last one only
    partly matched when `tokens` is not a multiple of the page size), and the nodes on its path
    (those a use of the match marks as used)."""

    tokens: int
    pages: list[int]
    nodes: list[RadixNode]


class RadixTree:
    """The cached prefixes of one isolation partition.

    Guarantees, checked by `check`: children are keyed by their first token and start where their
    parent ends; each node owns exactly the pages whose last position it holds; every leaf ends
    on a page boundary and owns at least one page; `owners` maps each page to its node.
    """

    def __init__(
        self,
        page_size: int,
        owners: PageOwners | None = None,
        on_leaf: Callable[[RadixNode, RadixTree], None] | None = None,
    ) -> None:
        self.page_size = page_size
        self.root = RadixNode(node_id=0, start=0, tokens=[], pages=[], parent=None)
        # page -> owning node; shared by all partitions of one cache so a page move is found
        # in O(1) whatever partition holds the page
        self.owners: PageOwners = PageOwners() if owners is None else owners
        self.leaves: set[RadixNode] = set()
        # told of every node that becomes a leaf (a new one, or a parent whose last child went),
        # so the cache's eviction order learns of it without scanning
        self.on_leaf = on_leaf
        self._next_id = 1

    @property
    def is_empty(self) -> bool:
        return not self.root.children

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(reversed(self.root.children.values()))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    def pages(self) -> Iterator[int]:
        for node in self.nodes():
            yield from node.pages

    # ---- matching -------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], length: int | None = None) -> TreeMatch:
        """The longest prefix of `tokens[:length]` the tree holds, at token granularity; changes
        nothing. (`length` spares the caller a copy of a long prompt.)"""
        page_size = self.page_size
        n = len(tokens) if length is None else min(length, len(tokens))
        node, pos = self.root, 0
        pages: list[int] = []
        path: list[RadixNode] = []
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            common = common_prefix_len(tokens, pos, child.tokens, n)
            path.append(child)
            node = child
            if common < len(child.tokens):
                pos += common
                pages.extend(child.pages[: pos // page_size - child.start // page_size])
                break
            pos += common
            pages.extend(child.pages)
        if pos % page_size:
            owner = self._owner_below(node, pos // page_size)
            pages.append(owner.pages[pos // page_size - owner.start // page_size])
        return TreeMatch(pos, pages, path)

    def _owner_below(self, node: RadixNode, page_index: int) -> RadixNode:
        """The node at or below `node` that owns page `page_index`.

        Any branch will do: all of them hold the same tokens up to the matched position. The
        branch is not part of the match's path: only a few tokens of one of its pages are read,
        so it does not count as used (it would otherwise keep an idle branch from eviction).
        """
        page_end = (page_index + 1) * self.page_size
        while node.end < page_end:
            node = next(iter(node.children.values()))
        return node

    def mark_used(self, path: Sequence[RadixNode], tokens: int, now: int, at: float = 0.0) -> None:
        """Record that a request used the first `tokens` positions along `path` (a match's nodes)
        at tick `now` (clock seconds `at`).

        A match that ends inside an edge first splits it there, so that the unmatched rest keeps
        its own, older use and is evicted before the part that was just used.
        """
        if not path:
            return
        last = path[-1]
        used = list(path)
        if last.parent is not None and last.start < tokens < last.end:
            used[-1] = self._split(last, tokens - last.start)
        for node in used:
            node.last_access = now
            node.hits += 1
            node.used_at = at

    # ---- inserting ------------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        now: int,
        whole: int | None = None,
        at: float = 0.0,
    ) -> list[int]:
        """Add a sequence of whole pages (`len(tokens) == len(pages) * page_size`), or only its
        first `whole` pages and the tokens they hold (sparing the caller a copy of a long
        sequence); return the pages the tree took, which are those past the part it already
        held."""
        page_size = self.page_size
        if whole is None:
            whole = len(pages)
            if len(tokens) != whole * page_size:
                raise ValueError(f"insert whole pages: {len(tokens)} tokens in {whole} pages")
        elif not 0 <= whole <= len(pages) or len(tokens) < whole * page_size:
            raise ValueError(f"insert {whole} whole pages of {len(pages)}, {len(tokens)} tokens")
        n = whole * page_size
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                rest = tokens[pos:n]
                taken = pages[pos // page_size : whole]
                leaf = self._add_leaf(
                    node,
                    pos,
                    rest if type(rest) is list else list(rest),
                    taken if type(taken) is list else list(taken),
                    now,
                )
                leaf.stored_at = leaf.used_at = at
                return leaf.pages
            common = common_prefix_len(tokens, pos, child.tokens, n)
            if common < len(child.tokens) and pos + common < n:
                child = self._split(child, common)
            child.last_access = now
            child.used_at = at
            node, pos = child, pos + common
        return []

    def _add_leaf(
        self, parent: RadixNode, start: int, tokens: list[int], pages: list[int], now: int
    ) -> RadixNode:
        leaf = RadixNode(self._next_id, start, tokens, pages, parent, now, now)
        self.owners.note(leaf)
        self._next_id += 1
        parent.children[tokens[0]] = leaf
        self.leaves.discard(parent)
        self.leaves.add(leaf)
        if self.on_leaf is not None:
            self.on_leaf(leaf, self)
        return leaf

    def _split(self, node: RadixNode, length: int) -> RadixNode:
        """Cut `node`'s edge after `length` tokens; return the new upper node (its parent now)."""
        page_size = self.page_size
        cut = node.start + length
        owned = cut // page_size - node.start // page_size
        upper = RadixNode(
            self._next_id,
            node.start,
            node.tokens[:length],
            node.pages[:owned],
            node.parent,
            created=node.created,
            last_access=node.last_access,
            hits=node.hits,
            stored_at=node.stored_at,
            used_at=node.used_at,
        )
        self._next_id += 1
        if node.parent is None:
            raise RadixTreeCorrupted(f"node {node.node_id} is split but is not in the tree")
        node.parent.children[upper.tokens[0]] = upper
        del node.tokens[:length]
        del node.pages[:owned]
        node.start = cut
        node.parent = upper
        upper.children[node.tokens[0]] = node
        if upper.pages:
            self.owners.note(upper)
        return upper

    # ---- removing -------------------------------------------------------------------------

    def drop_last_pages(self, leaf: RadixNode, count: int) -> tuple[list[int], RadixNode | None]:
        """Remove the last `count` pages of a leaf and the tokens only they held.

        A leaf left with no page is removed; a parent that becomes a leaf is cut back to its last
        page boundary (its tokens past it had their page in the removed child) and removed too
        if it then owns nothing. Returns the removed pages and the leaf that now ends the branch
        (`leaf` itself, or an ancestor that became a leaf); None when the branch now ends at a
        node with other children, or at the root.
        """
        if not leaf.is_leaf or leaf is self.root or not 0 < count <= len(leaf.pages):
            raise ValueError("drop_last_pages: needs a leaf and 1 to all of its pages")
        dropped = leaf.pages[-count:]
        del leaf.pages[-count:]
        keep = (leaf.end // self.page_size - count) * self.page_size - leaf.start
        node: RadixNode | None = leaf
        while node is not None and node is not self.root and node.is_leaf:
            if keep > 0:
                del node.tokens[keep:]
                if node is not leaf:
                    self.leaves.add(node)
                    if self.on_leaf is not None:
                        self.on_leaf(node, self)
                return dropped, node
            node = self._remove_leaf(node)
            if node is not None and node.is_leaf and node is not self.root:
                keep = node.end // self.page_size * self.page_size - node.start
        return dropped, None

    def _remove_leaf(self, leaf: RadixNode) -> RadixNode | None:
        """Unlink a leaf that owns no page; return its parent."""
        parent = leaf.parent
        if parent is None or leaf.pages:
            raise RadixTreeCorrupted(
                f"node {leaf.node_id} is removed but is not in the tree or still owns pages"
            )
        del parent.children[leaf.tokens[0]]
        self.leaves.discard(leaf)
        leaf.parent = None
        leaf.tokens = []  # a stale page-index entry may keep the node: not its tokens
        return parent

    # ---- checking and showing -------------------------------------------------------------

    def check(self) -> None:
        """Raise `RadixTreeCorrupted`, naming every `problems()`, unless the tree is consistent."""
        problems = self.problems()
        if problems:
            raise RadixTreeCorrupted("; ".join(problems))

    def problems(self) -> list[str]:
        """Every broken guarantee, described (empty when the tree is consistent)."""
        problems: list[str] = []
        page_size = self.page_size
        if self.root.pages or self.root.tokens:
            problems.append("the root holds tokens or pages")
        leaves: set[RadixNode] = set()
        for node in self.nodes():
            parent = node.parent
            where = f"node {node.node_id} [{node.start}, {node.end})"
            if (
                parent is None
                or parent.children.get(node.tokens[0] if node.tokens else -1) is not node
            ):
                problems.append(f"{where} is not its parent's child under its first token")
            elif node.start != parent.end:
                problems.append(f"{where} does not start where its parent ends")
            if len(node.pages) != node.end // page_size - node.start // page_size:
                problems.append(f"{where} owns {len(node.pages)} pages")
            if node.is_leaf:
                leaves.add(node)
                if node.end % page_size or not node.pages:
                    problems.append(f"{where} is a leaf that does not end on a whole page")
            problems.extend(
                f"page {page} of {where} is not indexed to it"
                for page in node.pages
                if self.owners.indexed(page) is not node
            )
        if leaves != self.leaves:
            problems.append("the set of leaves is out of date")
        return problems

    def render(self) -> str:
        """One line per node, indented by depth: `[start, end) tokens -> pages`, for tests."""
        lines = []

        def visit(node: RadixNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.tokens[0]):
                tokens = " ".join(map(str, child.tokens))
                pages = " ".join(map(str, child.pages))
                lines.append(f"{'  ' * depth}[{child.start}, {child.end}) {tokens} -> {pages}")
                visit(child, depth + 1)

        visit(self.root, 0)
        return "\n".join(lines)
