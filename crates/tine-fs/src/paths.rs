//! Relative paths inside a tree, as `/`-separated bytes (`""` is the root).

/// `prefix/name`, or `name` at the root.
pub fn join(prefix: &[u8], name: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(prefix.len() + 1 + name.len());
    if !prefix.is_empty() {
        v.extend_from_slice(prefix);
        v.push(b'/');
    }
    v.extend_from_slice(name);
    v
}

/// (parent, name); the parent of a top-level name is `""`.
pub fn split(path: &[u8]) -> (&[u8], &[u8]) {
    match path.iter().rposition(|&b| b == b'/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => (&[], path),
    }
}

/// True if `path` is `ancestor` or lies below it.
pub fn is_at_or_below(path: &[u8], ancestor: &[u8]) -> bool {
    path.starts_with(ancestor)
        && (path.len() == ancestor.len() || ancestor.is_empty() || path[ancestor.len()] == b'/')
}

/// The ancestors of `path` between the root and it, outermost first:
/// `a` and `a/b` for `a/b/c` (neither `""` nor `path` itself).
pub fn inner_ancestors(path: &[u8]) -> impl Iterator<Item = &[u8]> {
    path.iter()
        .enumerate()
        .filter(|(_, b)| **b == b'/')
        .map(move |(i, _)| &path[..i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_split_below() {
        assert_eq!(join(b"", b"a"), b"a");
        assert_eq!(join(b"a/b", b"c"), b"a/b/c");
        assert_eq!(split(b"a/b/c"), (&b"a/b"[..], &b"c"[..]));
        assert_eq!(split(b"c"), (&b""[..], &b"c"[..]));
        assert!(is_at_or_below(b"a/b", b"a"));
        assert!(is_at_or_below(b"a", b"a"));
        assert!(!is_at_or_below(b"ab", b"a"));
        assert!(is_at_or_below(b"x", b""));
        let a: Vec<&[u8]> = inner_ancestors(b"a/b/c").collect();
        assert_eq!(a, [&b"a"[..], &b"a/b"[..]]);
        assert_eq!(inner_ancestors(b"a").count(), 0);
    }
}
