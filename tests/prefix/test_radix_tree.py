"""The radix tree on its own: exact tree states after inserts, splits, matches and removals.

Page size 4 throughout; tokens are small ints so the rendered trees read at a glance. A node is
rendered `[start, end) tokens -> pages`, children indented under their parent.
"""

import pytest

from kvctl.agent.prefix import RadixTree, RadixTreeCorrupted
from kvctl.agent.prefix.radix_tree import common_prefix_len, relocate_pages


def tree_with(*sequences: tuple[list[int], list[int]]) -> RadixTree:
    tree = RadixTree(page_size=4)
    for now, (tokens, pages) in enumerate(sequences, start=1):
        tree.insert(tokens, pages, now)
    tree.check()
    return tree


def test_common_prefix_len_finds_the_first_difference_in_long_edges() -> None:
    edge = list(range(300))
    assert common_prefix_len(edge, 0, edge) == 300
    assert common_prefix_len([*range(200), -1], 0, edge) == 200
    assert common_prefix_len([9, *range(130)], 1, edge) == 130  # the query ends first
    assert common_prefix_len([*range(65), 7], 0, edge) == 65
    assert common_prefix_len(edge, 0, edge, end=100) == 100  # the query's first 100 tokens
    assert common_prefix_len(edge, 10, edge[10:], end=500) == 290  # an end past it is its end


def test_inserting_sequences_that_diverge_mid_page_splits_and_gives_each_branch_its_page() -> None:
    tree = tree_with(
        ([1, 2, 3, 4, 5, 6, 7, 8], [10, 11]),
        ([1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9], [20, 21, 22]),
    )
    # the split at position 6 is inside page 1: the upper node keeps page 0 only, and each
    # branch owns its own page 1 (same first two tokens, different last two)
    assert tree.render() == "\n".join(
        [
            "[0, 6) 1 2 3 4 5 6 -> 10",
            "  [6, 8) 7 8 -> 11",
            "  [6, 12) 9 9 9 9 9 9 -> 21 22",
        ]
    )
    spans = {page: (node.start, node.end) for page, node in tree.owners.items()}
    assert spans == {10: (0, 6), 11: (6, 8), 21: (6, 12), 22: (6, 12)}


def test_insert_returns_only_the_pages_the_tree_did_not_have() -> None:
    tree = tree_with(([1, 2, 3, 4, 5, 6, 7, 8], [10, 11]))
    assert tree.insert([1, 2, 3, 4], [30], now=5) == []  # already there: page 30 stays private
    assert tree.insert([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0], [40, 41, 42], now=6) == [42]
    assert tree.render() == "[0, 8) 1 2 3 4 5 6 7 8 -> 10 11\n  [8, 12) 0 0 0 0 -> 42"
    with pytest.raises(ValueError, match="whole pages"):
        tree.insert([1, 2, 3], [50], now=7)


def test_match_is_token_granular_and_takes_a_partial_page_from_below() -> None:
    tree = tree_with(
        ([1, 2, 3, 4, 5, 6, 7, 8], [10, 11]),
        ([1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9], [20, 21, 22]),
    )
    full = tree.match([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert (full.tokens, full.pages) == (8, [10, 11])
    # 5 tokens: page 0 whole, page 1 partly; the upper node owns no page 1, a branch does
    mid = tree.match([1, 2, 3, 4, 5, 0])
    assert (mid.tokens, mid.pages) == (5, [10, 11])
    # diverging at the split point itself (position 6, mid-page) still uses a branch's page 1
    at_split = tree.match([1, 2, 3, 4, 5, 6, 0])
    assert (at_split.tokens, at_split.pages) == (6, [10, 11])
    inside = tree.match([1, 2, 3, 4, 5, 6, 9, 9, 9, 0])
    assert (inside.tokens, inside.pages) == (9, [10, 21, 22])
    assert tree.match([2, 2]).tokens == 0
    assert tree.match([]).pages == []


def test_a_use_that_ends_inside_an_edge_splits_it_so_the_rest_keeps_its_older_use() -> None:
    tree = tree_with(([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], [10, 11, 12]))  # inserted at tick 1
    match = tree.match([1, 2, 3, 4, 5, 6, 0])
    tree.mark_used(match.nodes, match.tokens, now=7)
    assert tree.render() == "[0, 6) 1 2 3 4 5 6 -> 10\n  [6, 12) 7 8 9 9 9 9 -> 11 12"
    upper = tree.root.children[1]
    rest = upper.children[7]
    assert (upper.last_access, upper.hits) == (7, 1)
    assert (rest.last_access, rest.hits, rest.created) == (1, 0, 1)
    tree.check()
    whole = tree.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 0])  # ends where a node ends
    tree.mark_used(whole.nodes, whole.tokens, now=8)
    assert (upper.last_access, rest.last_access, rest.hits) == (8, 8, 1)
    assert len(list(tree.nodes())) == 2


def test_dropping_the_last_pages_trims_the_leaf_then_removes_it_and_cuts_the_parent_back() -> None:
    tree = tree_with(
        ([1, 2, 3, 4, 5, 6, 7, 8], [10, 11]),
        ([1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9], [20, 21, 22]),
    )
    long_branch = tree.root.children[1].children[9]
    assert tree.drop_last_pages(long_branch, 1) == ([22], long_branch)
    assert tree.render().splitlines()[2] == "  [6, 8) 9 9 -> 21"
    assert tree.drop_last_pages(long_branch, 1) == ([21], None)  # the parent still has a child
    short_branch = tree.root.children[1].children[7]
    upper = tree.root.children[1]
    # the upper node becomes a leaf ending mid-page: tokens 5 and 6 had their page in the
    # removed branch, so it is cut back to its last whole page
    assert tree.drop_last_pages(short_branch, 1) == ([11], upper)
    assert tree.render() == "[0, 4) 1 2 3 4 -> 10"
    tree.check()
    assert tree.drop_last_pages(upper, 1) == ([10], None)
    assert tree.is_empty and tree.owners == {} and tree.leaves == set()


def test_a_parent_that_owns_no_page_is_removed_with_its_last_child() -> None:
    tree = tree_with(
        ([1, 2, 3, 4, 5, 6, 7, 8], [10, 11]),
        ([1, 2, 3, 4, 5, 9, 9, 9], [20, 21]),
        ([1, 2, 3, 4, 5, 6, 0, 0], [30, 31]),
    )
    assert tree.render() == "\n".join(
        [
            "[0, 5) 1 2 3 4 5 -> 10",
            "  [5, 6) 6 -> ",
            "    [6, 8) 0 0 -> 31",
            "    [6, 8) 7 8 -> 11",
            "  [5, 8) 9 9 9 -> 21",
        ]
    )
    middle = tree.root.children[1].children[6]
    tree.drop_last_pages(middle.children[0], 1)
    tree.drop_last_pages(middle.children[7], 1)
    assert tree.render() == "[0, 5) 1 2 3 4 5 -> 10\n  [5, 8) 9 9 9 -> 21"
    tree.check()


def test_relocation_renames_pages_in_their_nodes() -> None:
    tree = tree_with(([1, 2, 3, 4, 5, 6, 7, 8], [10, 11]), ([1, 2, 3, 4, 0, 0, 0, 0], [20, 21]))
    assert relocate_pages(tree.owners, {11: 3, 10: 2, 99: 4}) == 2
    assert tree.render() == "[0, 4) 1 2 3 4 -> 2\n  [4, 8) 0 0 0 0 -> 21\n  [4, 8) 5 6 7 8 -> 3"
    tree.check()


def test_check_reports_a_broken_tree() -> None:
    tree = tree_with(([1, 2, 3, 4, 5, 6, 7, 8], [10, 11]))
    tree.root.children[1].pages.append(12)
    assert any("owns 3 pages" in problem for problem in tree.problems())
    with pytest.raises(RadixTreeCorrupted, match="owns 3 pages"):
        tree.check()


def test_insert_can_take_the_first_whole_pages_of_a_longer_sequence() -> None:
    tree = RadixTree(page_size=4)
    assert tree.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12], now=1, whole=2) == [10, 11]
    assert tree.render() == "[0, 8) 1 2 3 4 5 6 7 8 -> 10 11"
    with pytest.raises(ValueError, match="whole pages"):
        tree.insert([1, 2, 3, 4, 5], [10, 11], now=2, whole=2)
    assert tree.match([1, 2, 3, 4, 5, 6, 7, 8, 9], length=6).tokens == 6
    tree.check()


def test_the_page_index_names_each_page_of_the_tree_and_forgets_those_that_left() -> None:
    """It is brought up to date when read: pages of nodes that were dropped, split or moved are
    found where they are now, whatever happened in between."""
    tree = RadixTree(page_size=1)
    tree.insert([1, 2, 3, 4], [7, 5, 9, 2], now=1)  # scattered pages
    tree.insert([1, 2, 8, 8, 8], [7, 5, 20, 21, 22], now=2)  # splits after 2 tokens
    leaf = tree.root.children[1].children[8]
    assert tree.drop_last_pages(leaf, 2) == ([21, 22], leaf)
    assert dict(tree.owners.items()) == {
        7: tree.root.children[1],
        5: tree.root.children[1],
        9: tree.root.children[1].children[3],
        2: tree.root.children[1].children[3],
        20: leaf,
    }
    assert 21 not in tree.owners and tree.owners.get(22) is None
    assert relocate_pages(tree.owners, {22: 30, 9: 31}) == 1  # 22 left the tree
    assert tree.render() == "[0, 2) 1 2 -> 7 5\n  [2, 4) 3 4 -> 31 2\n  [2, 3) 8 -> 20"
    tree.check()


def test_the_page_index_stays_right_through_many_changes_it_is_not_read_during() -> None:
    tree = RadixTree(page_size=1)
    for i in range(3000):
        pages = [2 * i, 2 * i + 1] if i % 2 else [2 * i + 1, 2 * i]
        tree.insert([i, i + 1], pages, now=i)
        if i >= 10:
            old = tree.root.children[i - 10]
            tree.drop_last_pages(old, 2)
    assert sorted(tree.owners) == sorted(tree.pages())
    tree.check()
