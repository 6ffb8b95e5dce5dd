//! The devices a sandbox may use on cgroup v2: an eBPF program of type
//! `BPF_PROG_TYPE_CGROUP_DEVICE` attached to its group, which allows
//! [`crate::cgroup::ALLOWED_DEVICES`] and refuses every other device (open
//! and mknod), as the v1 `devices` controller does where a host has it.
//!
//! The program is a list of checks emitted here (a dozen instructions per
//! rule), loaded with `bpf(BPF_PROG_LOAD)` and attached with
//! `bpf(BPF_PROG_ATTACH)`; the attachment holds it, so its descriptor is
//! closed at once.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// `BPF_PROG_LOAD`, `BPF_PROG_ATTACH` (linux/bpf.h).
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
/// `BPF_PROG_TYPE_CGROUP_DEVICE`, `BPF_CGROUP_DEVICE`.
const PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const ATTACH_CGROUP_DEVICE: u32 = 6;
/// `BPF_DEVCG_DEV_BLOCK`, `BPF_DEVCG_DEV_CHAR`.
const DEV_BLOCK: i32 = 1;
const DEV_CHAR: i32 = 2;
/// `BPF_DEVCG_ACC_MKNOD | READ | WRITE`.
const ACC_ALL: i32 = 1 | 2 | 4;

/// One allowed device (or every minor of a major).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    kind: i32,
    major: i32,
    /// `None`: every minor.
    minor: Option<i32>,
    /// `BPF_DEVCG_ACC_*` bits.
    access: i32,
}

/// Parses a v1 `devices.allow` line (`c 1:3 rwm`, `c 136:* rwm`).
pub fn parse(line: &str) -> Option<Rule> {
    let mut f = line.split_whitespace();
    let kind = match f.next()? {
        "c" => DEV_CHAR,
        "b" => DEV_BLOCK,
        _ => return None,
    };
    let (major, minor) = f.next()?.split_once(':')?;
    let major = major.parse().ok()?;
    let minor = match minor {
        "*" => None,
        m => Some(m.parse().ok()?),
    };
    let mut access = 0;
    for c in f.next()?.chars() {
        access |= match c {
            'm' => 1,
            'r' => 2,
            'w' => 4,
            _ => return None,
        };
    }
    Some(Rule {
        kind,
        major,
        minor,
        access,
    })
}

/// One eBPF instruction: opcode, registers (dst low nibble, src high), offset, immediate.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0] = code;
    b[1] = (src << 4) | (dst & 0xf);
    b[2..4].copy_from_slice(&off.to_le_bytes());
    b[4..8].copy_from_slice(&imm.to_le_bytes());
    b
}

const LDX_W: u8 = 0x61; // dst = *(u32 *)(src + off)
const ALU32_AND_K: u8 = 0x54;
const ALU32_RSH_K: u8 = 0x74;
const ALU32_MOV_X: u8 = 0xbc;
const MOV64_K: u8 = 0xb7;
const JNE_K: u8 = 0x55; // if dst != imm: skip off
const JSET_K: u8 = 0x45; // if dst & imm: skip off
const EXIT: u8 = 0x95;

/// The program: 1 (allow) for a device a rule names with every access
/// asked for within the rule's, else 0 (refuse).
pub fn program(rules: &[Rule]) -> Vec<[u8; 8]> {
    // struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; },
    // access_type = access << 16 | type.
    let mut p = vec![
        insn(LDX_W, 2, 1, 0, 0),
        insn(ALU32_MOV_X, 3, 2, 0, 0),
        insn(ALU32_AND_K, 2, 0, 0, 0xffff),
        insn(ALU32_RSH_K, 3, 0, 0, 16),
        insn(LDX_W, 4, 1, 4, 0),
        insn(LDX_W, 5, 1, 8, 0),
    ];
    for r in rules {
        let mut checks = vec![(JNE_K, 2, r.kind), (JSET_K, 3, !r.access & ACC_ALL)];
        checks.push((JNE_K, 4, r.major));
        if let Some(m) = r.minor {
            checks.push((JNE_K, 5, m));
        }
        // Each check skips the rest of this rule: its later checks and the
        // two instructions that allow.
        let n = checks.len();
        for (i, (code, reg, imm)) in checks.into_iter().enumerate() {
            p.push(insn(code, reg, 0, (n - i - 1 + 2) as i16, imm));
        }
        p.push(insn(MOV64_K, 0, 0, 0, 1));
        p.push(insn(EXIT, 0, 0, 0, 0));
    }
    p.push(insn(MOV64_K, 0, 0, 0, 0));
    p.push(insn(EXIT, 0, 0, 0, 0));
    p
}

/// `union bpf_attr` for `BPF_PROG_LOAD`, up to `expected_attach_type`.
#[repr(C)]
#[derive(Default)]
struct LoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// `union bpf_attr` for `BPF_PROG_ATTACH`.
#[repr(C)]
#[derive(Default)]
struct AttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a `union bpf_attr` prefix laid out as the kernel's
    // (repr(C), zeroed beyond what is set), valid for the size passed; the
    // pointers inside it point to live buffers of the sizes given.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T,
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

/// Loads the program for `rules` and attaches it to the cgroup v2 group
/// `dir`. A verifier refusal carries the verifier's log.
pub fn attach(dir: &Path, rules: &[Rule]) -> io::Result<()> {
    let code: Vec<u8> = program(rules).concat();
    let license = c"Apache-2.0";
    let mut log = vec![0u8; 1 << 16];
    let mut load = LoadAttr {
        prog_type: PROG_TYPE_CGROUP_DEVICE,
        insn_cnt: (code.len() / 8) as u32,
        insns: code.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 1,
        log_size: log.len() as u32,
        log_buf: log.as_mut_ptr() as u64,
        ..LoadAttr::default()
    };
    load.prog_name[..10].copy_from_slice(b"tine_devcg");
    let prog = bpf(BPF_PROG_LOAD, &mut load).map_err(|e| {
        let text = String::from_utf8_lossy(&log[..log.iter().position(|&b| b == 0).unwrap_or(0)])
            .trim()
            .to_string();
        if text.is_empty() {
            e
        } else {
            io::Error::new(e.kind(), format!("{e}; verifier: {text}"))
        }
    })?;
    // SAFETY: BPF_PROG_LOAD returned a new descriptor that nothing else owns.
    let prog = unsafe { OwnedFd::from_raw_fd(prog as i32) };
    let group = std::fs::File::open(dir)?;
    let mut at = AttachAttr {
        target_fd: group.as_raw_fd() as u32,
        attach_bpf_fd: prog.as_raw_fd() as u32,
        attach_type: ATTACH_CGROUP_DEVICE,
        attach_flags: 0,
    };
    bpf(BPF_PROG_ATTACH, &mut at)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_parse_as_the_v1_lines_say() {
        assert_eq!(
            parse("c 136:* rwm"),
            Some(Rule {
                kind: DEV_CHAR,
                major: 136,
                minor: None,
                access: 7
            })
        );
        assert_eq!(parse("b 7:0 r").unwrap().access, 2);
        for bad in ["x 1:3 rwm", "c 1 rwm", "c 1:3 rwx", "c a:3 r", ""] {
            assert_eq!(parse(bad), None, "{bad}");
        }
        for line in crate::cgroup::ALLOWED_DEVICES {
            assert!(parse(line).is_some(), "{line}");
        }
    }

    #[test]
    fn each_rule_is_a_block_of_checks_that_skip_to_the_next() {
        let rules = [parse("c 1:3 rwm").unwrap(), parse("c 136:* rw").unwrap()];
        let p = program(&rules);
        // 6 loads, 4 checks + 2 for the first rule, 3 + 2 for the second, 2 to refuse.
        assert_eq!(p.len(), 6 + 6 + 5 + 2);
        // The first rule's first check skips 3 checks and the allow pair.
        assert_eq!(p[6][0], JNE_K);
        assert_eq!(i16::from_le_bytes([p[6][2], p[6][3]]), 5);
        // Its access check refuses what the rule does not allow: nothing here.
        assert_eq!(i32::from_le_bytes(p[7][4..8].try_into().unwrap()), 0);
        // The second rule's access check refuses mknod.
        assert_eq!(p[13][0], JSET_K);
        assert_eq!(i32::from_le_bytes(p[13][4..8].try_into().unwrap()), 1);
        assert_eq!(p.last().unwrap()[0], EXIT);
    }
}
