//! What the unit tests look at: programs started and waited for.

use std::io::BufRead;

/// Python (`python`: its path) running `script`, once it has printed its
/// first line, which is returned with it.
pub(crate) fn python_ready(python: &str, script: &str) -> (std::process::Child, String) {
    let mut c = std::process::Command::new(python)
        .args(["-c", script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(c.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    (c, line)
}
