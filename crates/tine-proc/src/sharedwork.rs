//! Work of a known number of items shared between threads: each thread
//! takes the next item none took yet till none is left, and one waits for
//! them all (a rollback's put-back pieces, the objects its processes must
//! have made anew). A panicking item is counted done, so no thread waits
//! for it forever.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

#[derive(Debug)]
pub struct SharedWork<T> {
    n: usize,
    next: AtomicUsize,
    /// Each item's result (none where it panicked), and how many are done.
    done: Mutex<(Vec<Option<T>>, usize)>,
    all_done: Condvar,
}

impl<T> SharedWork<T> {
    pub fn new(n: usize) -> SharedWork<T> {
        SharedWork {
            n,
            next: AtomicUsize::new(0),
            done: Mutex::new(((0..n).map(|_| None).collect(), 0)),
            all_done: Condvar::new(),
        }
    }

    /// Does the next item (`f` of its index), if one is left (whether one was).
    pub fn take_one(&self, f: impl FnOnce(usize) -> T) -> bool {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        if i >= self.n {
            return false;
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))).ok();
        let mut d = self.done.lock().unwrap_or_else(|p| p.into_inner());
        d.0[i] = r;
        d.1 += 1;
        self.all_done.notify_all();
        true
    }

    /// Does items till none is left.
    pub fn take(&self, f: impl Fn(usize) -> T) {
        while self.take_one(&f) {}
    }

    /// Once every item is done: their results, or none if one panicked.
    /// (Taken: a second call finds none.)
    pub fn wait(&self) -> Option<Vec<T>> {
        let mut d = self.done.lock().unwrap_or_else(|p| p.into_inner());
        while d.1 < self.n {
            d = self.all_done.wait(d).unwrap_or_else(|p| p.into_inner());
        }
        std::mem::take(&mut d.0).into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_work_is_done_once_each_across_threads_and_a_panic_fails_it_without_a_hang() {
        let work = std::sync::Arc::new(SharedWork::new(50));
        let calls = AtomicUsize::new(0);
        let f = |i: usize| {
            calls.fetch_add(1, Ordering::Relaxed);
            i * 2
        };
        std::thread::scope(|s| {
            let w = work.clone();
            s.spawn(move || w.take(f));
            work.take(f);
        });
        assert_eq!(work.wait(), Some((0..50).map(|i| i * 2).collect()));
        assert_eq!(calls.into_inner(), 50, "each item once");
        let failing = SharedWork::new(3);
        failing.take(|i| if i == 1 { panic!("item 1") } else { i });
        assert_eq!(failing.wait(), None);
    }
}
