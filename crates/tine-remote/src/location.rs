//! Remote addresses: `s3://bucket/prefix` and `file:///absolute/path`.

use std::path::PathBuf;

use crate::RemoteError;

/// Where a remote lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A bucket of an S3-compatible store, and a key prefix in it ("" for the whole bucket).
    S3 { bucket: String, prefix: String },
    /// A directory.
    File { path: PathBuf },
}

fn bad(url: &str, reason: &str) -> RemoteError {
    RemoteError::BadUrl {
        url: url.to_string(),
        reason: reason.to_string(),
    }
}

impl Location {
    /// Parses a remote URL. Prefix segments must be plain names (no `.`, `..`,
    /// empty segments or control characters), so every key tine writes stays
    /// under the prefix.
    pub fn parse(url: &str) -> Result<Location, RemoteError> {
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            let valid_bucket = (3..=63).contains(&bucket.len())
                && bucket.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'
                })
                && !bucket.starts_with(['-', '.'])
                && !bucket.ends_with(['-', '.']);
            if !valid_bucket {
                return Err(bad(
                    url,
                    "the bucket name must be 3-63 lowercase letters, digits, '-' or '.'",
                ));
            }
            let prefix = prefix.trim_end_matches('/');
            if !prefix.is_empty() {
                for seg in prefix.split('/') {
                    if seg.is_empty()
                        || seg == "."
                        || seg == ".."
                        || seg.chars().any(|c| c.is_control())
                    {
                        return Err(bad(
                            url,
                            "the prefix must be names separated by single '/' (no '.', '..' or empty parts)",
                        ));
                    }
                }
            }
            return Ok(Location::S3 {
                bucket: bucket.to_string(),
                prefix: prefix.to_string(),
            });
        }
        if let Some(rest) = url.strip_prefix("file://") {
            if !rest.starts_with('/') {
                return Err(bad(url, "a file URL needs an absolute path: file:///path"));
            }
            let path = PathBuf::from(rest);
            if path
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
            {
                return Err(bad(url, "the path must not contain '..'"));
            }
            return Ok(Location::File { path });
        }
        Err(bad(url, "use s3://bucket/prefix or file:///absolute/path"))
    }

    /// The last part of the address: what `tine clone` names its directory after.
    pub fn default_dir_name(&self) -> String {
        let last = match self {
            Location::S3 { bucket, prefix } => prefix
                .rsplit('/')
                .next()
                .filter(|s| !s.is_empty())
                .unwrap_or(bucket),
            Location::File { path } => path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("tine-clone"),
        };
        last.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_s3_and_file_urls() {
        assert_eq!(
            Location::parse("s3://my-bucket/a/b/").unwrap(),
            Location::S3 {
                bucket: "my-bucket".into(),
                prefix: "a/b".into()
            }
        );
        assert_eq!(
            Location::parse("s3://my-bucket").unwrap(),
            Location::S3 {
                bucket: "my-bucket".into(),
                prefix: "".into()
            }
        );
        assert_eq!(
            Location::parse("file:///srv/tine").unwrap(),
            Location::File {
                path: "/srv/tine".into()
            }
        );
        assert_eq!(
            Location::parse("s3://b-1/x/y").unwrap().default_dir_name(),
            "y"
        );
        assert_eq!(
            Location::parse("s3://b-1").unwrap().default_dir_name(),
            "b-1"
        );
    }

    #[test]
    fn refuses_what_could_escape_or_is_not_a_remote() {
        for url in [
            "http://x/y",
            "s3://",
            "s3://UPPER/x",
            "s3://b/../x",
            "s3://bkt/a//b",
            "s3://bkt/./b",
            "file://relative/path",
            "file:///a/../b",
            "/plain/path",
        ] {
            let e = Location::parse(url).unwrap_err();
            assert!(e.to_string().contains(url), "{e}");
        }
    }
}
