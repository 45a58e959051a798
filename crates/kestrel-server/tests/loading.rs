//! `serve` while the model loads and when it fails to: the server listens at once, `/health`
//! and the completion routes answer 503 until the model is ready, then 200; a model that fails
//! to load stops `serve` with the loader's error.

use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use kestrel_core::Config;
use kestrel_engine::{BackendChoice, Engine, EngineOptions, Model, ModelSource};
use kestrel_server::{serve, ServeOptions, ServerError};

fn options() -> ServeOptions {
    ServeOptions {
        host: "127.0.0.1".into(),
        port: 0,
        api_key: None,
        model_name: "tiny".into(),
        max_body: 1 << 20,
        max_queue: 4,
        max_seqs: 1,
    }
}

fn builtin() -> Result<Engine, String> {
    let model = Model::open(&ModelSource::Builtin).map_err(|e| e.to_string())?;
    let mut opts = EngineOptions::with_ctx(256);
    opts.backend = Some(BackendChoice::Cpu);
    Engine::new(model, &Config::default(), opts).map_err(|e| e.to_string())
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into()
}

#[test]
fn requests_wait_for_the_model_with_503() {
    let (release, released) = channel::<()>();
    let (addr_tx, addr) = channel();
    std::thread::spawn(move || {
        let load = move || {
            released.recv().map_err(|e| e.to_string())?;
            builtin()
        };
        let _ = serve(options(), load, move |a| addr_tx.send(a).unwrap());
    });
    let base = format!("http://{}", addr.recv_timeout(Duration::from_secs(30)).unwrap());
    let agent = agent();
    let mut health = agent.get(format!("{base}/health")).call().unwrap();
    assert_eq!(health.status().as_u16(), 503);
    assert!(health.body_mut().read_to_string().unwrap().contains("loading"));
    let body = r#"{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}"#;
    let mut r = agent
        .post(format!("{base}/v1/chat/completions"))
        .send(body)
        .unwrap();
    assert_eq!(r.status().as_u16(), 503);
    let v: serde_json::Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
    assert_eq!(v["error"]["type"], "service_unavailable");

    release.send(()).unwrap();
    let start = Instant::now();
    while agent
        .get(format!("{base}/health"))
        .call()
        .unwrap()
        .status()
        .as_u16()
        != 200
    {
        assert!(start.elapsed() < Duration::from_secs(60), "never ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = agent
        .post(format!("{base}/v1/chat/completions"))
        .send(body)
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
}

#[test]
fn a_model_that_fails_to_load_stops_the_server_with_its_error() {
    let load = || Err::<Engine, _>("the weights are missing".to_string());
    let e = serve(options(), load, |_| {}).unwrap_err();
    assert!(
        matches!(&e, ServerError::Load(m) if m == "the weights are missing"),
        "{e}"
    );
}

#[test]
fn a_taken_address_is_an_error_naming_it() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let opts = ServeOptions { port, ..options() };
    let e = serve(opts, builtin, |_| {}).unwrap_err();
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
}
