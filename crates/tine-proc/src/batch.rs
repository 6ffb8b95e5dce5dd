//! Many system calls injected in one stop. Each call injected on its own
//! costs a round trip between tine and the process (registers set, a step,
//! a wait, registers read): about 14 µs on the development VM, most of it
//! two context switches, whatever the call does. A batch puts its calls in
//! a table in memory mapped into the process for the purpose, next to a
//! small loop of code that makes each call in turn and traps at the end
//! (or at the first that fails): one round trip for all of them. A call's
//! result can be written into an argument of a later one (a descriptor a
//! call made, passed to the next), and a batch can carry the bytes its
//! calls point at (names, structures).
//!
//! The mapping ([`Stub`]) is shared anonymous memory (never merged with the
//! program's own mappings), made by one injected `mmap` and removed by one
//! `munmap` before the process runs again: the program never sees it.

use nix::libc;

use crate::inspect::ProcError;
use crate::ptrace::Tracee;

/// The loop, x86-64. On entry `rbx` points at the first entry of a table
/// and `r12` holds how many there are. For each: the call number and six
/// arguments are loaded, the call made, its result stored in the entry and
/// at the (up to two) addresses the entry names; a result from -4095 to -1
/// (an error) stops the loop. It ends in `int3`, `rbx` at the entry it
/// stopped on (past the last when all ran).
const CODE: [u8; 80] = [
    0x4D, 0x85, 0xE4, // 0: test r12, r12
    0x74, 0x4A, // 3: jz done (79)
    0x48, 0x8B, 0x03, // 5: mov rax, [rbx]
    0x48, 0x8B, 0x7B, 0x08, // 8: mov rdi, [rbx+8]
    0x48, 0x8B, 0x73, 0x10, // 12: mov rsi, [rbx+16]
    0x48, 0x8B, 0x53, 0x18, // 16: mov rdx, [rbx+24]
    0x4C, 0x8B, 0x53, 0x20, // 20: mov r10, [rbx+32]
    0x4C, 0x8B, 0x43, 0x28, // 24: mov r8, [rbx+40]
    0x4C, 0x8B, 0x4B, 0x30, // 28: mov r9, [rbx+48]
    0x0F, 0x05, // 32: syscall
    0x48, 0x89, 0x43, 0x38, // 34: mov [rbx+56], rax
    0x48, 0x8B, 0x4B, 0x40, // 38: mov rcx, [rbx+64]
    0x48, 0x85, 0xC9, // 42: test rcx, rcx
    0x74, 0x03, // 45: jz 50
    0x48, 0x89, 0x01, // 47: mov [rcx], rax
    0x48, 0x8B, 0x4B, 0x48, // 50: mov rcx, [rbx+72]
    0x48, 0x85, 0xC9, // 54: test rcx, rcx
    0x74, 0x03, // 57: jz 62
    0x48, 0x89, 0x01, // 59: mov [rcx], rax
    0x48, 0x3D, 0x01, 0xF0, 0xFF, 0xFF, // 62: cmp rax, -4095
    0x73, 0x09, // 68: jae done (79)
    0x48, 0x83, 0xC3, 0x50, // 70: add rbx, 80
    0x49, 0xFF, 0xCC, // 74: dec r12
    0xEB, 0xB1, // 77: jmp 0
    0xCC, // 79: done: int3
];

/// Bytes of one table entry: number, six arguments, result, two addresses
/// the result is also stored at.
const ENTRY: u64 = 80;
/// Where the tables and data start in the mapping.
const TABLES_AT: u64 = 128;
/// The mapping's size: room for the batches of one rollback or fork.
const STUB_SIZE: u64 = 64 << 10;

/// An argument of a call in a [`Batch`].
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    /// This value.
    Val(u64),
    /// The address of bytes the batch carries (from [`Batch::data`]).
    Data(usize),
    /// The result of an earlier call of the batch (its index).
    Result(usize),
}

/// The address of bytes a [`Batch`] carries.
#[derive(Debug, Clone, Copy)]
pub struct DataRef(usize);

impl From<DataRef> for Arg {
    fn from(d: DataRef) -> Arg {
        Arg::Data(d.0)
    }
}

impl From<u64> for Arg {
    fn from(v: u64) -> Arg {
        Arg::Val(v)
    }
}

#[derive(Debug, Clone)]
struct Call {
    name: &'static str,
    nr: i64,
    args: [Arg; 6],
}

/// Calls to make in one thread in one stop, in order.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    calls: Vec<Call>,
    data: Vec<u8>,
    /// Offsets in `data` that take the address of other offsets in it.
    links: Vec<(usize, usize)>,
}

impl Batch {
    pub fn new() -> Batch {
        Batch::default()
    }

    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// How many calls it holds.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// Carries `bytes` (8-byte aligned); their address is an argument.
    pub fn data(&mut self, bytes: &[u8]) -> DataRef {
        let at = self.data.len();
        self.data.extend_from_slice(bytes);
        self.data.resize(self.data.len().next_multiple_of(8), 0);
        DataRef(at)
    }

    /// Carries `bytes` as [`Batch::data`] does, each `(at, target)` of
    /// `links` the address of the carried bytes' offset `target`, written
    /// at their offset `at` (a structure pointing into itself).
    pub fn data_linked(&mut self, bytes: &[u8], links: &[(usize, usize)]) -> DataRef {
        let d = self.data(bytes);
        self.links
            .extend(links.iter().map(|&(at, target)| (d.0 + at, d.0 + target)));
        d
    }

    /// Adds call `nr` (named `name` in errors); returns its index, for
    /// [`Arg::Result`].
    pub fn call(&mut self, name: &'static str, nr: i64, args: [Arg; 6]) -> usize {
        self.calls.push(Call { name, nr, args });
        self.calls.len() - 1
    }

    /// [`Batch::call`] with plain values only.
    pub fn call_vals(&mut self, name: &'static str, nr: i64, args: [u64; 6]) -> usize {
        self.call(name, nr, args.map(Arg::Val))
    }

    /// The table and data, laid out at `at`.
    fn encode(&self, at: u64) -> Result<Vec<u8>, &'static str> {
        let table = self.calls.len() as u64 * ENTRY;
        let data_at = at + table;
        let mut words: Vec<[u64; 10]> = Vec::with_capacity(self.calls.len());
        for (i, c) in self.calls.iter().enumerate() {
            let mut w = [0u64; 10];
            w[0] = c.nr as u64;
            for (k, a) in c.args.iter().enumerate() {
                w[1 + k] = match *a {
                    Arg::Val(v) => v,
                    Arg::Data(off) => data_at + off as u64,
                    Arg::Result(j) if j < i => {
                        // Stored there by call `j` as it returns.
                        let slot = at + i as u64 * ENTRY + 8 + 8 * k as u64;
                        let e: &mut [u64; 10] = &mut words[j];
                        if e[8] == 0 {
                            e[8] = slot;
                        } else if e[9] == 0 {
                            e[9] = slot;
                        } else {
                            return Err("a result used by more than two later calls");
                        }
                        0
                    }
                    Arg::Result(_) => return Err("a result used before it is made"),
                };
            }
            words.push(w);
        }
        let mut out = Vec::with_capacity(table as usize + self.data.len());
        for w in &words {
            for v in w {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out.extend_from_slice(&self.data_at(data_at));
        Ok(out)
    }

    /// The bytes it carries, laid out at `at` (their links pointing there).
    fn data_at(&self, at: u64) -> Vec<u8> {
        let mut data = self.data.clone();
        for &(off, target) in &self.links {
            let addr = at + target as u64;
            data[off..off + 8].copy_from_slice(&addr.to_le_bytes());
        }
        data
    }
}

/// A batch of at most this many calls is made one by one: its mapping
/// costs more (made, written, its shared page touched, removed: measured
/// on numpy's rollback) than that many round trips.
const ONE_BY_ONE_AT_MOST: usize = 6;
/// The most bytes of data a batch made one by one puts below the stack.
const SCRATCH_DATA_AT_MOST: usize = 4096;

/// Makes the calls of `b` in stopped thread `t`, in order, and returns
/// their results: one by one when they are so few that a batch would not
/// pay (the bytes they carry written below its stack's red zone, see
/// [`Tracee::scratch`]), else as one batch.
pub fn run_in(t: &mut Tracee, b: &Batch) -> Result<Vec<i64>, ProcError> {
    if b.calls.len() <= ONE_BY_ONE_AT_MOST && b.data.len() <= SCRATCH_DATA_AT_MOST {
        let base = if b.data.is_empty() {
            0
        } else {
            let at = t.scratch_address(0, b.data.len());
            t.poke_at(at, &b.data_at(at))?;
            at
        };
        let mut results: Vec<i64> = Vec::with_capacity(b.calls.len());
        for c in &b.calls {
            let args = c.args.map(|a| match a {
                Arg::Val(v) => v,
                Arg::Result(j) => results.get(j).map_or(0, |&r| r as u64),
                Arg::Data(off) => base + off as u64,
            });
            results.push(t.syscall(c.name, c.nr, args)? as i64);
        }
        return Ok(results);
    }
    let mut stub = Stub::map(t)?;
    let ran = stub.place(t, b).and_then(|p| stub.run(t, p, b));
    let unmapped = stub.unmap(t);
    let (results, _) = ran?;
    unmapped?;
    Ok(results)
}

/// The code and tables mapped into a stopped process. Removed by
/// [`Stub::unmap`] before the process runs again; dropped without, it stays
/// mapped (harmless, never run without tine).
#[derive(Debug)]
pub struct Stub {
    at: u64,
    /// The next free byte for tables.
    next: u64,
}

/// A batch written into a [`Stub`], ready to run in any thread of the
/// process.
#[derive(Debug, Clone, Copy)]
pub struct Placed {
    table: u64,
    count: usize,
}

impl Stub {
    /// Maps the code into stopped process `t` (one injected `mmap`).
    pub fn map(t: &mut Tracee) -> Result<Stub, ProcError> {
        let at = t.syscall(
            "mmap (injected calls' code)",
            libc::SYS_mmap,
            [
                0,
                STUB_SIZE,
                (libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC) as u64,
                (libc::MAP_SHARED | libc::MAP_ANONYMOUS) as u64,
                u64::MAX,
                0,
            ],
        )?;
        t.poke_at(at, &CODE)?;
        Ok(Stub {
            at,
            next: TABLES_AT,
        })
    }

    /// Removes it from `t` (one injected `munmap`).
    pub fn unmap(self, t: &mut Tracee) -> Result<(), ProcError> {
        t.syscall(
            "munmap (injected calls' code)",
            libc::SYS_munmap,
            [self.at, STUB_SIZE, 0, 0, 0, 0],
        )?;
        Ok(())
    }

    /// Writes `b` into the mapping (through `t`, any thread of its process).
    pub fn place(&mut self, t: &mut Tracee, b: &Batch) -> Result<Placed, ProcError> {
        let table = self.at + self.next;
        let bytes = b.encode(table).map_err(|why| ProcError::Ptrace {
            pid: t.pid(),
            step: "lay out injected calls",
            source: std::io::Error::other(why),
        })?;
        let end = self.next + (bytes.len() as u64).next_multiple_of(16);
        if end > STUB_SIZE {
            return Err(ProcError::Ptrace {
                pid: t.pid(),
                step: "lay out injected calls",
                source: std::io::Error::other("more calls than the mapping holds"),
            });
        }
        t.poke_at(table, &bytes)?;
        self.next = end;
        Ok(Placed {
            table,
            count: b.calls.len(),
        })
    }

    /// Runs placed batch `p` of `b` in thread `t` and returns each call's
    /// result, and the threads or processes its calls made (each stopped,
    /// not yet waited for: see [`Tracee::take_made`]). The first call that
    /// fails ends the batch: [`ProcError::Injected`], naming it.
    pub fn run(
        &self,
        t: &mut Tracee,
        p: Placed,
        b: &Batch,
    ) -> Result<(Vec<i64>, Vec<u32>), ProcError> {
        self.start(t, p)?;
        let (regs, made) = t.wait_made()?;
        self.outcome(t, p, b, regs.rbx).map(|r| (r, made))
    }

    /// The results of batch `p` stopped with `rbx` at `stopped_at`.
    fn outcome(
        &self,
        t: &mut Tracee,
        p: Placed,
        b: &Batch,
        stopped_at: u64,
    ) -> Result<Vec<i64>, ProcError> {
        let done = stopped_at.saturating_sub(p.table) / ENTRY;
        let ran = (done as usize + 1).min(p.count);
        let table = t.peek(p.table, ran * ENTRY as usize)?;
        let results: Vec<i64> = (0..ran)
            .map(|i| {
                let at = i * ENTRY as usize + 56;
                i64::from_le_bytes(table[at..at + 8].try_into().expect("8 bytes"))
            })
            .collect();
        if (done as usize) < p.count {
            let r = results[done as usize];
            return Err(ProcError::Injected {
                pid: t.pid(),
                call: b.calls[done as usize].name,
                source: std::io::Error::from_raw_os_error(-r as i32),
            });
        }
        Ok(results)
    }

    /// Starts placed batch `p` in thread `t` without waiting for it (see
    /// [`Stub::finish`]): batches in several threads run side by side.
    pub fn start(&self, t: &mut Tracee, p: Placed) -> Result<(), ProcError> {
        t.start_at(self.at, p.table, p.count as u64)
    }

    /// Waits for batch `p` of `b`, started in `t` by [`Stub::start`].
    pub fn finish(&self, t: &mut Tracee, p: Placed, b: &Batch) -> Result<Vec<i64>, ProcError> {
        let (regs, _) = t.wait_made()?;
        self.outcome(t, p, b, regs.rbx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_made_one_by_one_points_into_itself_where_it_is_put() {
        let mut b = Batch::new();
        b.data(b"xyz");
        // A structure whose first word points at its byte 8.
        let mut s = vec![0u8; 16];
        s[8] = 0x5a;
        let d = b.data_linked(&s, &[(0, 8)]);
        let at = 0x7000;
        let data = b.data_at(at);
        // "xyz" padded to 8, then the structure.
        assert_eq!(d.0, 8);
        assert_eq!(u64::from_le_bytes(data[8..16].try_into().unwrap()), at + 16);
        assert_eq!(data[16], 0x5a);
        // The same bytes a batch carries after its table.
        let table = b.encode(at).unwrap();
        assert_eq!(&table[..], &b.data_at(at)[..]);
    }

    #[test]
    fn results_are_wired_into_later_calls_and_data_is_placed_after_the_table() {
        let mut b = Batch::new();
        let name = b.data(b"abc");
        let first = b.call_vals("eventfd2", 290, [0, 0, 0, 0, 0, 0]);
        b.call(
            "dup3",
            292,
            [
                Arg::Result(first),
                Arg::Val(7),
                Arg::Val(0),
                0.into(),
                0.into(),
                0.into(),
            ],
        );
        b.call(
            "close",
            3,
            [
                Arg::Result(first),
                name.into(),
                0.into(),
                0.into(),
                0.into(),
                0.into(),
            ],
        );
        let at = 0x1000;
        let bytes = b.encode(at).unwrap();
        let word = |e: usize, k: usize| {
            let o = e * ENTRY as usize + 8 * k;
            u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap())
        };
        assert_eq!(word(0, 0), 290);
        // The first call's result goes into dup3's and close's first argument.
        assert_eq!(word(0, 8), at + ENTRY + 8);
        assert_eq!(word(0, 9), at + 2 * ENTRY + 8);
        assert_eq!(word(1, 2), 7);
        assert_eq!(word(2, 2), at + 3 * ENTRY);
        assert_eq!(&bytes[3 * ENTRY as usize..3 * ENTRY as usize + 3], b"abc");
        // A result used before it is made, or by a third call, is refused.
        let mut bad = Batch::new();
        bad.call(
            "x",
            1,
            [
                Arg::Result(0),
                0.into(),
                0.into(),
                0.into(),
                0.into(),
                0.into(),
            ],
        );
        assert!(bad.encode(at).is_err());
    }

    #[test]
    fn the_loop_jumps_where_it_says() {
        // jz done, jae done, jmp back to the start: targets by offset.
        let rel = |at: usize| CODE[at + 1] as i8 as isize;
        assert_eq!(5 + rel(3), 79);
        assert_eq!(70 + rel(68), 79);
        assert_eq!(79 + rel(77), 0);
        assert_eq!(CODE[79], 0xCC);
        assert_eq!(&CODE[32..34], &[0x0F, 0x05]);
    }
}
