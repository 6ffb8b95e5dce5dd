//! Owners between the host and a sandbox: the ID range a sandbox's user
//! namespace maps onto, and the conversion of owners both ways.

use tine_store::Owner;

/// IDs `0..count` inside a sandbox are `host_uid..` and `host_gid..` on the
/// host. Scans given one record owners as the sandbox sees them; restores
/// given one give every entry its recorded owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdMap {
    pub host_uid: u32,
    pub host_gid: u32,
    pub count: u32,
}

impl IdMap {
    /// Every ID as itself: what the host's root sees is what is recorded
    /// (an image's layers applied by root keep their owners).
    pub const IDENTITY: IdMap = IdMap {
        host_uid: 0,
        host_gid: 0,
        count: u32::MAX,
    };

    /// The owner a host `uid`/`gid` is inside. One the range does not map
    /// (a file the host put into the workspace) is taken as the sandbox
    /// root's, as a mount makes such layers.
    pub fn inside(&self, uid: u32, gid: u32) -> Owner {
        let one = |id: u32, first: u32| match id.checked_sub(first) {
            Some(d) if d < self.count => d,
            _ => 0,
        };
        Owner {
            uid: one(uid, self.host_uid),
            gid: one(gid, self.host_gid),
        }
    }

    /// The host's (uid, gid) for a recorded owner; one outside the range
    /// (a snapshot taken with a larger one) becomes the sandbox's root.
    pub fn host(&self, o: Owner) -> (u32, u32) {
        if o.uid < self.count && o.gid < self.count {
            (self.host_uid + o.uid, self.host_gid + o.gid)
        } else {
            self.root()
        }
    }

    /// The sandbox's root as the host sees it.
    pub fn root(&self) -> (u32, u32) {
        (self.host_uid, self.host_gid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_map_both_ways_and_unmapped_ids_are_the_sandbox_roots() {
        let m = IdMap {
            host_uid: 1 << 30,
            host_gid: (1 << 30) + 7,
            count: 65536,
        };
        let pg = Owner { uid: 105, gid: 108 };
        let (u, g) = m.host(pg);
        assert_eq!((u, g), ((1 << 30) + 105, (1 << 30) + 7 + 108));
        assert_eq!(m.inside(u, g), pg);
        assert_eq!(m.inside(0, 0), Owner::ROOT);
        assert_eq!(
            m.inside(1 << 31, (1 << 30) + 7 + 1),
            Owner { uid: 0, gid: 1 }
        );
        assert_eq!(m.host(Owner { uid: 70000, gid: 1 }), m.root());
    }
}
