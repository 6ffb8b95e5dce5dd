//! `tine image import / ls / show / export / rm`: container images in the
//! repository, through the operations (local, or a daemon's with `--url`).

use std::path::PathBuf;

use clap::Subcommand;
use tine_engine::{ExportImage, ImageView, ImportImage, Imported};

use super::Cx;
use crate::output::{CliError, plural, size, time};

#[derive(Debug, Subcommand)]
pub enum ImageCmd {
    /// Import an image from an OCI image layout (a directory), an OCI
    /// archive, or a `docker save`/`podman save` archive (uncompressed tar).
    /// Each layer becomes a snapshot of the root filesystem so far; layers
    /// another image already brought are reused.
    Import {
        /// The archive or layout.
        #[arg(
            value_name = "PATH",
            required_unless_present = "podman",
            conflicts_with = "podman"
        )]
        path: Option<PathBuf>,
        /// Instead of PATH: an image in Podman's local store (a name or id).
        #[arg(long, value_name = "NAME")]
        podman: Option<String>,
        /// Which image, when the source holds several (a name, or leading
        /// digits of its id).
        #[arg(long, value_name = "NAME")]
        image: Option<String>,
        /// A name to give it (repeatable; default: the names the source gives).
        #[arg(short = 't', long = "name", value_name = "NAME")]
        names: Vec<String>,
        /// Stop once the layers unpack to more than SIZE (default 64G: no
        /// real image comes near; a hostile one, a gzip bomb, stops here).
        #[arg(long, value_name = "SIZE", value_parser = crate::commands::sandbox::parse_size)]
        max_size: Option<u64>,
        /// Stop past N entries in all (default 4000000).
        #[arg(long, value_name = "N")]
        max_entries: Option<u64>,
        /// Refuse an entry more than N directories deep (default 256).
        #[arg(long, value_name = "N")]
        max_depth: Option<usize>,
    },
    /// List the images.
    Ls,
    /// One image: its layers, and what it runs.
    Show { image: String },
    /// Write an image as an OCI archive (`podman load -i FILE` reads it).
    Export {
        image: String,
        /// The archive to write (replaced if it is there).
        #[arg(short, long, value_name = "FILE")]
        output: PathBuf,
    },
    /// Remove images, or names of them (an image with other names keeps
    /// those). Sandboxes made from an image keep what they use.
    Rm {
        #[arg(required = true)]
        images: Vec<String>,
    },
}

fn short(id: &str) -> &str {
    let hex = id.strip_prefix("sha256:").unwrap_or(id);
    hex.get(..12).unwrap_or(hex)
}

fn name_of(v: &ImageView) -> String {
    v.names
        .first()
        .cloned()
        .unwrap_or_else(|| "<none>".to_string())
}

fn show_text(v: &ImageView) -> String {
    let mut s = format!(
        "image {}\nid        {}\nnames     {}\nsnapshot  {}\nlayers    {}\nsource    {}\nimported  {}\n",
        name_of(v),
        v.id,
        if v.names.is_empty() {
            "(none)".to_string()
        } else {
            v.names.join(", ")
        },
        &v.snapshot[..12],
        v.layers,
        v.source,
        time(v.created_ns)
    );
    let list = |xs: &[String]| serde_json::to_string(xs).unwrap_or_default();
    if !v.entrypoint.is_empty() {
        s.push_str(&format!("entrypoint {}\n", list(&v.entrypoint)));
    }
    if !v.cmd.is_empty() {
        s.push_str(&format!("cmd       {}\n", list(&v.cmd)));
    }
    if let Some(w) = &v.workdir {
        s.push_str(&format!("workdir   {w}\n"));
    }
    if let Some(u) = &v.user {
        s.push_str(&format!("user      {u}\n"));
    }
    for e in &v.env {
        s.push_str(&format!("env       {e}\n"));
    }
    s
}

fn imported_text(i: &Imported) -> String {
    let mut s = format!(
        "imported {} ({}): {}, {} applied, {} reused; store grew {} in {:.2} s\n",
        name_of(&i.image),
        short(&i.image.id),
        plural(i.image.layers as u64, "layer"),
        i.layers_applied,
        i.layers_reused,
        size(i.stored_bytes),
        i.seconds
    );
    for k in &i.skipped {
        s.push_str(&format!("  skipped (a sandbox has no such files): {k}\n"));
    }
    s
}

pub fn run(cx: &Cx<'_>, cmd: ImageCmd) -> Result<(), CliError> {
    let json = cx.json;
    match cmd {
        ImageCmd::Import {
            path,
            podman,
            image,
            names,
            max_size,
            max_entries,
            max_depth,
        } => {
            let req = ImportImage {
                path: path.map(super::sandbox::absolute).unwrap_or_default(),
                image,
                podman,
                names,
                max_bytes: max_size,
                max_entries,
                max_depth,
            };
            let out = cx.ops()?.import_image(&req, &cx.ctx)?;
            crate::emit(json, doc(&out), || imported_text(&out));
        }
        ImageCmd::Ls => {
            let all = cx.ops()?.images()?;
            crate::emit(json, doc(&all), || {
                if all.is_empty() {
                    return "(no images: `tine image import PATH`)\n".to_string();
                }
                let mut s = format!(
                    "{:<40} {:<12} {:>6}  {}\n",
                    "NAME", "ID", "LAYERS", "IMPORTED"
                );
                for v in &all {
                    let names: Vec<String> = if v.names.is_empty() {
                        vec!["<none>".into()]
                    } else {
                        v.names.clone()
                    };
                    for n in names {
                        s.push_str(&format!(
                            "{:<40} {:<12} {:>6}  {}\n",
                            n,
                            short(&v.id),
                            v.layers,
                            time(v.created_ns)
                        ));
                    }
                }
                s
            });
        }
        ImageCmd::Export { image, output } => {
            let req = ExportImage {
                image,
                path: super::sandbox::absolute(output),
            };
            let out = cx.ops()?.export_image(&req, &cx.ctx)?;
            crate::emit(json, doc(&out), || {
                format!(
                    "exported {} to {} ({}, {}, id {})\n",
                    out.image,
                    out.path.display(),
                    plural(out.layers as u64, "layer"),
                    size(out.bytes),
                    short(&out.id)
                )
            });
        }
        ImageCmd::Show { image } => {
            let v = cx.ops()?.image(&image)?;
            crate::emit(json, doc(&v), || show_text(&v));
        }
        ImageCmd::Rm { images } => {
            let ops = cx.ops()?;
            let mut done = Vec::new();
            for i in &images {
                done.push(ops.remove_image(i, &cx.ctx)?);
            }
            crate::emit(json, doc(&done), || {
                done.iter()
                    .map(|r| {
                        if r.image {
                            format!(
                                "removed image {} ({}){}\n",
                                short(&r.id),
                                if r.names.is_empty() {
                                    "no names".to_string()
                                } else {
                                    r.names.join(", ")
                                },
                                if r.released.is_empty() {
                                    String::new()
                                } else {
                                    format!(
                                        "; {} of its layers kept: something else depends on them",
                                        plural(r.released.len() as u64, "snapshot")
                                    )
                                }
                            )
                        } else {
                            format!(
                                "untagged {} from image {}\n",
                                r.names.join(", "),
                                short(&r.id)
                            )
                        }
                    })
                    .collect()
            });
        }
    }
    Ok(())
}

/// An answer, as `--json` prints it.
fn doc<T: serde::Serialize>(t: &T) -> serde_json::Value {
    serde_json::to_value(t).unwrap_or_default()
}
